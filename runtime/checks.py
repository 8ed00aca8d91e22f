"""The runtime's checks beyond the bundle's own verification (``mbert.bundle.open_bundle``).

* A loaded graph or engine must have the inputs and outputs the manifest records (:func:`check_graph_io`).
* A TensorRT plan must have been built for this machine's TensorRT version and GPU (:func:`engine_problems`).
* The eager backend and parity checks load the source checkpoint, which must be the one the bundle
  was exported from (:func:`load_eager_model`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from mbert.bundle import Bundle, EngineRecord
from mbert.bundle.manifest import REEXPORT
from mbert.modeling.errors import BundleError, MbertError


def check_graph_io(bundle: Bundle, artifact: str, inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """The loaded graph's / engine's own input and output names must be the manifest's."""
    io = bundle.manifest.io
    want_in, want_out = [i.name for i in io.inputs], list(io.output_names)
    if sorted(inputs) != sorted(want_in) or sorted(outputs) != sorted(want_out):
        raise BundleError(f"{bundle.path}: {artifact} has inputs {list(inputs)} and outputs {list(outputs)}, the "
                          f"manifest says {want_in} and {want_out}; {REEXPORT}")


def engine_problems(engine: EngineRecord | None, tensorrt_version: str, compute_capability: str) -> list[str]:
    """What differs between the machine a plan was built on and this one.

    A plan runs only on the TensorRT version that built it and on GPUs of the same compute
    capability; the GPU's name may differ (same architecture, other SKU) and is not compared.
    """
    if engine is None:
        return ["the manifest records no engine (export with --fp16 on a GPU machine)"]
    problems = []
    if engine.tensorrt_version != str(tensorrt_version):
        problems.append(f"TensorRT version: plan built with {engine.tensorrt_version}, this machine has "
                        f"{tensorrt_version}")
    if engine.compute_capability != str(compute_capability):
        problems.append(f"GPU compute capability: plan built for {engine.compute_capability} ({engine.gpu_name}), "
                        f"this GPU is {compute_capability}")
    return problems


def check_engine(bundle: Bundle, tensorrt_version: str, compute_capability: str) -> None:
    """BundleError saying what differs and how to rebuild when the plan was built elsewhere."""
    problems = engine_problems(bundle.manifest.engine, tensorrt_version, compute_capability)
    if problems:
        raise BundleError(
            f"{bundle.path}: model.plan cannot run here: {'; '.join(problems)}. Rebuild the engine on this machine "
            f"with: mbert-export --engine-only {bundle.path} (or run the ONNX graph with backend='onnxruntime')")


def current_gpu(device: int = 0) -> tuple[str, str]:
    """(GPU name, "9.0"-style compute capability) through torch; ("none", "none") without a GPU."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device)
            return torch.cuda.get_device_name(device), f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - a broken CUDA install reads as no GPU
        pass
    return "none", "none"


def eager_source(bundle: Bundle, source: str | Path | None = None) -> str | Path:
    """Where the eager model comes from: ``source`` if given, else the exported folder if it still
    exists, else the hub id; BundleError naming what is needed when none is available (a bundle
    holds no PyTorch weights)."""
    if source is not None:
        return source
    src = bundle.manifest.source
    if (Path(src.path) / "config.json").is_file():
        return Path(src.path)
    if src.id:
        return src.id
    raise BundleError(
        f"{bundle.path}: the eager PyTorch backend needs the checkpoint this bundle was exported from "
        f"({src.given}), because a bundle holds no PyTorch weights; it is not at {src.path} and the manifest "
        "names no hub id. Pass source=FOLDER (--source FOLDER)")


def load_eager_model(bundle: Bundle, source: str | Path | None = None, device: Any = "cpu"):
    """The source checkpoint's eager model, checked to be the one the bundle was exported from."""
    from mbert.modeling import load_model

    where = eager_source(bundle, source)
    revision = bundle.manifest.source.revision if source is None else None
    try:
        model = load_model(where, device=device, task=bundle.manifest.task, revision=revision)
    except MbertError as exc:
        raise BundleError(f"{bundle.path}: the eager backend needs the source checkpoint {where}, which could not "
                          f"be loaded: {exc}") from exc
    ours = json.loads((bundle.path / "config.json").read_text(encoding="utf-8"))
    theirs = json.loads((Path(model.source.path) / "config.json").read_text(encoding="utf-8"))
    if ours != theirs:
        raise BundleError(f"{bundle.path}: the source checkpoint {where} has a different config.json than the "
                          "bundle; it changed since export (pass the original checkpoint as source, or re-export)")
    return model
