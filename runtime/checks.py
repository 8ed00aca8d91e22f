"""Opening a bundle for serving: the checks that run before any backend loads.

1. ``mbert.export.bundle.read_manifest(verify=True)``: format version, and every listed file's
   size and sha256 (a swapped, edited or missing model / tokenizer / config file is named).
2. The manifest itself is not hashed (the exporter writes the hashes into it), so its values are
   cross-checked against the hashed files they were derived from: ``model`` and ``labels``
   against ``config.json``, ``pooling`` against ``modules.json`` & co, ``io`` against the task and
   pooling (and, when a backend loads, against the graph's or engine's own inputs and outputs),
   artifacts against the hash table. A manifest that carries ``manifest_sha256`` (sha256 of the
   canonical JSON of every other key) is checked against it, which also covers values such as
   ``max_seq_len`` that no hashed file records.
3. For TensorRT: the plan's recorded TensorRT version and GPU compute capability against this
   machine (:func:`engine_problems`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mbert.export.bundle import MANIFEST, manifest_digest, read_manifest
from mbert.modeling.errors import BundleError, MbertError

REEXPORT = "re-export the bundle (mbert-export SOURCE --out BUNDLE --overwrite) rather than editing it"
TASKS = ("encoder", "masked-lm", "sequence-classification", "token-classification")


def open_manifest(bundle: str | Path, verify: bool = True) -> dict:
    """The verified manifest of ``bundle``; BundleError naming every difference otherwise."""
    bundle = Path(bundle)
    manifest = read_manifest(bundle, verify=verify)
    check_manifest(bundle, manifest)
    return manifest


def expected_outputs(task: str, pooling: dict | None, hidden: int, vocab: int, labels: int) -> dict[str, list]:
    """Output name -> shape the exporter's GraphModule produces for this task and pooling."""
    if task == "encoder":
        out = {"last_hidden_state": ["batch", "sequence", hidden]}
        if pooling is not None:
            out["sentence_embedding"] = ["batch", hidden * len(pooling["modes"])]
        return out
    return {"logits": {"masked-lm": ["batch", "sequence", vocab],
                       "sequence-classification": ["batch", labels],
                       "token-classification": ["batch", "sequence", labels]}[task]}


def check_manifest(bundle: Path, manifest: dict) -> None:
    """Cross-check the (unhashed) manifest against the hashed files; BundleError listing every problem."""
    from mbert.modeling import ModernBertConfig, load_pooling

    problems: list[str] = []
    files = manifest.get("files") or {}
    if "manifest_sha256" in manifest and manifest["manifest_sha256"] != manifest_digest(manifest):
        problems.append("manifest.json was edited after export (its manifest_sha256 does not match its content)")
    if "config.json" not in files:
        raise BundleError(f"{bundle}: the manifest lists no config.json; {REEXPORT}")
    try:
        cfg = ModernBertConfig.from_file(bundle / "config.json")
    except MbertError as exc:
        raise BundleError(f"{bundle}: {exc}") from exc
    task = manifest.get("task")
    if task not in TASKS:
        problems.append(f"task {task!r} is not one of {', '.join(TASKS)}")
    elif task != "encoder" and task != cfg.task:
        problems.append(f"task is {task!r} in the manifest, {cfg.task!r} in config.json")
    model = manifest.get("model") or {}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "local_attention", "vocab_size",
                "pad_token_id", "cls_token_id", "sep_token_id"):
        if key in model and model[key] != getattr(cfg, key):
            problems.append(f"model.{key} is {model[key]!r} in the manifest, {getattr(cfg, key)!r} in config.json")
        elif key not in model and key != "num_attention_heads":
            problems.append(f"model.{key} is missing from the manifest")
    if task in ("sequence-classification", "token-classification"):
        want = {str(k): v for k, v in cfg.id2label.items()}
        if (manifest.get("labels") or {}) != want:
            problems.append(f"labels are {manifest.get('labels')!r} in the manifest, {want!r} in config.json")
    max_len = manifest.get("max_seq_len")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or not 1 <= max_len <= cfg.max_position_embeddings:
        problems.append(f"max_seq_len {max_len!r} is outside 1..{cfg.max_position_embeddings} "
                        "(max_position_embeddings in config.json)")
    pooling = manifest.get("pooling")
    if task == "encoder":
        try:
            declared = load_pooling(bundle)
        except MbertError as exc:
            raise BundleError(f"{bundle}: {exc}") from exc
        declared_dict = declared.to_dict() if declared is not None else None
        if declared_dict != pooling:
            problems.append(f"pooling is {pooling!r} in the manifest, but modules.json / 1_Pooling / "
                            f"sentence_bert_config.json declare {declared_dict!r}")
    elif pooling is not None:
        problems.append(f"a {task} bundle must not declare pooling (manifest has {pooling!r})")
    for kind, name in (manifest.get("artifacts") or {}).items():
        if kind != "triton" and isinstance(name, str) and name not in files:
            problems.append(f"artifact {kind} ({name}) is not covered by the manifest's file hashes")
    if "onnx_fp32" not in (manifest.get("artifacts") or {}):
        problems.append("artifacts.onnx_fp32 is missing")
    if task in TASKS:
        want_out = expected_outputs(task, pooling if task == "encoder" else None, cfg.hidden_size,
                                    cfg.vocab_size, cfg.num_labels)
        io = manifest.get("io") or {}
        got_out = {o.get("name"): list(o.get("shape") or []) for o in io.get("outputs") or []}
        if got_out != want_out:
            problems.append(f"io.outputs are {got_out} in the manifest; a {task} bundle with this config "
                            f"and pooling has {want_out}")
        got_in = [i.get("name") for i in io.get("inputs") or []]
        if got_in != ["input_ids", "attention_mask"]:
            problems.append(f"io.inputs are {got_in}, expected ['input_ids', 'attention_mask']")
    if problems:
        raise BundleError(f"{bundle}: {MANIFEST} does not match the bundle's files: " + "; ".join(problems)
                          + f". {REEXPORT.capitalize()}")


def check_graph_io(bundle: Path, manifest: dict, artifact: str, inputs: list[str], outputs: list[str]) -> None:
    """The loaded graph's / engine's own input and output names must be the manifest's."""
    io = manifest["io"]
    want_in = [i["name"] for i in io["inputs"]]
    want_out = [o["name"] for o in io["outputs"]]
    if sorted(inputs) != sorted(want_in) or sorted(outputs) != sorted(want_out):
        raise BundleError(f"{bundle}: {artifact} has inputs {inputs} and outputs {outputs}, the manifest says "
                          f"{want_in} and {want_out}; {REEXPORT}")


# --- TensorRT engine compatibility -------------------------------------------------------------

def engine_problems(engine: dict | None, tensorrt_version: str, compute_capability: str) -> list[str]:
    """What differs between the machine a plan was built on (its manifest ``engine`` record) and this one.

    A plan runs only on the TensorRT version that built it and on GPUs of the same compute
    capability; the GPU's name may differ (same architecture, other SKU) and is not compared.
    """
    if not engine:
        return ["the manifest records no engine (export with --fp16 on a GPU machine)"]
    problems = []
    built_trt = str(engine.get("tensorrt_version", "unknown"))
    if built_trt != str(tensorrt_version):
        problems.append(f"TensorRT version: plan built with {built_trt}, this machine has {tensorrt_version}")
    built_cc = str(engine.get("compute_capability", "unknown"))
    if built_cc != str(compute_capability):
        problems.append(f"GPU compute capability: plan built for {built_cc} ({engine.get('gpu_name', 'unknown GPU')}), "
                        f"this GPU is {compute_capability}")
    return problems


def check_engine(bundle: Path, manifest: dict, tensorrt_version: str, compute_capability: str) -> None:
    """BundleError saying what differs and how to rebuild when the plan was built elsewhere."""
    problems = engine_problems(manifest.get("engine"), tensorrt_version, compute_capability)
    if problems:
        raise BundleError(
            f"{bundle}: model.plan cannot run here: {'; '.join(problems)}. Rebuild the engine on this machine "
            f"with: mbert-export --engine-only {bundle} (or run the ONNX graph with backend='onnxruntime')")


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


# --- the eager reference's source checkpoint -----------------------------------------------------

def eager_source(bundle: Path, manifest: dict, source: str | Path | None = None) -> str | Path:
    """Where the eager model comes from: ``source`` if given, else the exported folder if it still
    exists, else the hub id; BundleError naming what is needed when none is available (a bundle
    holds no PyTorch weights)."""
    if source is not None:
        return source
    src = manifest.get("source") or {}
    path = src.get("path")
    if path and (Path(path) / "config.json").is_file():
        return Path(path)
    if src.get("id"):
        return src["id"]
    raise BundleError(
        f"{bundle}: the eager PyTorch backend needs the checkpoint this bundle was exported from "
        f"({src.get('given') or path or 'unknown'}), because a bundle holds no PyTorch weights; it is not at "
        f"{path or '(no path recorded)'} and the manifest names no hub id. Pass source=FOLDER (--source FOLDER)")


def load_eager_model(bundle: Path, manifest: dict, source: str | Path | None = None, device: Any = "cpu"):
    """The source checkpoint's eager model, checked to be the one the bundle was exported from."""
    from mbert.modeling import load_model

    where = eager_source(bundle, manifest, source)
    revision = (manifest.get("source") or {}).get("revision") if source is None else None
    try:
        model = load_model(where, device=device, task=manifest["task"], revision=revision)
    except MbertError as exc:
        raise BundleError(f"{bundle}: the eager backend needs the source checkpoint {where}, which could not be "
                          f"loaded: {exc}") from exc
    folder = model.source.path
    ours = json.loads((bundle / "config.json").read_text(encoding="utf-8"))
    theirs = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    if ours != theirs:
        raise BundleError(f"{bundle}: the source checkpoint {where} has a different config.json than the bundle; "
                          "it changed since export (pass the original checkpoint as source, or re-export)")
    return model
