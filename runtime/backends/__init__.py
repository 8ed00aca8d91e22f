"""The runtime's backends behind one small interface.

* ``tensorrt``: the bundle's ``model.plan`` through :class:`mbert.runtime.backends.tensorrt.TensorRTRunner`
  (FP16 as the plan was built; CUDA through cuda-python's driver API, no torch), with the family that built it (TensorRT or TensorRT-RTX), where
  :func:`mbert.runtime.backends.checks.can_run` allows it; a plan exported "built, not yet run" runs the
  parity grid on its first open on a GPU (:mod:`mbert.runtime.backends.verdicts`). A TensorRT execution
  context is not thread-safe: calls are serialized with a lock (one context, so GPU memory does
  not grow with the number of threads).
* ``onnxruntime-cuda`` / ``onnxruntime-cpu``: ONNX Runtime. On CUDA the mixed-precision
  ``model.fp16.onnx`` by default, on CPU the FP32 ``model.onnx`` (``precision`` overrides);
  ``precision="int8"`` runs ``model.int8.onnx`` (dynamic INT8, ``--int8``) and only on the CPU.
  ``InferenceSession.run`` is thread-safe, so calls run concurrently.
* ``eager``: the PyTorch reference (``mbert.modeling.graph.GraphModule`` on the source checkpoint; a
  bundle holds no PyTorch weights). FP32 only. Forward passes of an eval module are thread-safe. It is
  the only backend that needs torch (the ``[export]`` extra): :mod:`mbert.runtime.eager` is
  imported only when it is asked for.

Every backend pads by the same rule (:func:`mbert.runtime.text.padded_length`): the longest row rounded up to a
multiple of 8, moved into the range of a TensorRT optimization profile when there are profiles.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from mbert.bundle import Bundle
from mbert.bundle.errors import BundleError, OptionError
from mbert.runtime.backends.checks import can_run, check_graph_io
from mbert.runtime.backends.cuda import current_gpu
from mbert.runtime.backends.onnxruntime import OrtBackend, cuda_available
from mbert.runtime.backends.tensorrt import open_tensorrt

log = logging.getLogger("mbert.runtime")
BACKENDS = ("auto", "tensorrt", "onnxruntime", "onnxruntime-cuda", "onnxruntime-cpu", "eager")
_ALIASES = {"trt": "tensorrt", "ort": "onnxruntime", "onnx": "onnxruntime", "torch": "eager", "pytorch": "eager"}


@runtime_checkable
class Backend(Protocol):
    """What the Encoder needs from a backend."""

    name: str  # "tensorrt", "onnxruntime-cuda", "onnxruntime-cpu", "eager"
    precision: str  # "fp32", "fp16" or "int8"
    artifact: str  # the bundle file (or source) it runs
    input_names: list[str]
    output_names: list[str]
    max_batch: int | None  # largest batch it accepts (None: no limit)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]: ...

    def pad_to(self, seq: int, batch: int = 1) -> int: ...


# --- choosing --------------------------------------------------------------------------------------

@dataclass
class BackendStatus:
    name: str
    usable: bool
    reason: str


def normalize_name(backend: str) -> str:
    name = _ALIASES.get(backend.lower(), backend.lower())
    if name not in BACKENDS:
        raise OptionError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return name


def _trt_status(bundle: Bundle) -> tuple[bool, str]:
    engine = bundle.manifest.engine
    if engine is None:
        return False, f"the bundle has no model.plan (build one: mbert-export --engine-only {bundle.path})"
    gpu = current_gpu()
    ok, problems = can_run(engine, gpu, bundle.path_of(engine.file, "engine.file"))
    if not ok:
        rebuild = f" (rebuild for this GPU: mbert-export --engine-only {bundle.path})" if gpu else ""
        return False, "; ".join(problems) + rebuild
    first = " (built, not yet run: the parity grid runs on first open)" if engine.validation is None else ""
    return True, f"runs {engine.file} with {engine.label}{first}"


def backend_statuses(bundle: Bundle, source: str | Path | None = None) -> list[BackendStatus]:
    """Which backends can run this bundle on this machine, and why not where they cannot."""
    m = bundle.manifest
    out = [BackendStatus("tensorrt", *_trt_status(bundle))]
    ok, why = cuda_available()
    fp16 = m.graph("fp16").file if m.graph("fp16") else f"{m.graph('fp32').file} (no FP16 graph in the bundle)"
    out.append(BackendStatus("onnxruntime-cuda", ok, f"runs {fp16}" if ok else why))
    try:
        import onnxruntime  # noqa: F401

        int8 = f"; {m.graph('int8').file} with precision int8" if m.graph("int8") else ""
        out.append(BackendStatus("onnxruntime-cpu", True, f"runs {m.graph('fp32').file} (FP32){int8}"))
    except ImportError:
        out.append(BackendStatus("onnxruntime-cpu", False, "onnxruntime is not installed"))
    try:
        from mbert.runtime.eager import eager_source, require_torch

        require_torch("the eager backend")
        where = eager_source(bundle, source)
        out.append(BackendStatus("eager", True, f"loads the source checkpoint {where}"))
    except BundleError as exc:
        out.append(BackendStatus("eager", False, str(exc).split(": ", 1)[-1]))
    return out


def _device(device: str | None) -> tuple[str | None, int]:
    if device is None:
        return None, 0
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise OptionError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return kind, int(index or 0)


def open_backend(bundle: Bundle, backend: str = "auto", device: str | None = None, precision: str | None = None,
                 *, threads: int | None = None, source=None, verdict_cache: Path | None = None) -> Backend:
    """Load the backend ``backend`` asks for (``auto``: TensorRT where the plan can run here, then ONNX
    Runtime CUDA, then CPU). ``verdict_cache``: where first-run verdicts of engines are kept
    (:mod:`mbert.runtime.backends.verdicts`; default the user's cache folder)."""
    name = normalize_name(backend)
    if precision not in (None, "fp32", "fp16", "int8"):
        raise OptionError(f"precision must be 'fp32', 'fp16' or 'int8', got {precision!r}")
    kind, index = _device(device)
    if precision == "int8":
        name = _int8_backend(name, kind)
    m = bundle.manifest
    max_seq = m.max_seq_len
    if name == "auto":
        if kind != "cpu" and precision != "fp32" and m.engine is not None:
            if can_run(m.engine, current_gpu(index), bundle.path_of(m.engine.file, "engine.file"))[0]:
                name = "tensorrt"  # a plan that fails its first parity run is refused below, not skipped
        if name == "auto":
            name = "onnxruntime-cuda" if kind != "cpu" and cuda_available()[0] else "onnxruntime-cpu"
            if kind == "cuda" and name == "onnxruntime-cpu":
                raise BundleError(f"device {device!r} asked for, but neither TensorRT nor ONNX Runtime CUDA "
                                  f"can run here: {cuda_available()[1]}")
    elif name == "onnxruntime":
        name = "onnxruntime-cpu" if kind == "cpu" or not cuda_available()[0] else "onnxruntime-cuda"

    if name == "tensorrt":
        b: Backend = open_tensorrt(bundle, precision, kind, index, verdict_cache)
    elif name.startswith("onnxruntime"):
        cuda = name == "onnxruntime-cuda"
        if cuda and not cuda_available()[0]:
            raise BundleError(f"ONNX Runtime CUDA cannot run here: {cuda_available()[1]}")
        if cuda and kind == "cpu":
            raise OptionError("backend 'onnxruntime-cuda' contradicts device='cpu'")
        want = precision or ("fp16" if cuda and m.graph("fp16") else "fp32")
        graph = m.graph(want)
        if graph is None:
            raise BundleError(f"{bundle.path}: has no {want} graph for precision={want!r}; re-export with --{want}")
        b = OrtBackend(bundle.path_of(graph.file, "graphs.file"), max_seq, cuda=cuda, precision=want, threads=threads,
                       device_id=index)
    else:  # eager
        if precision == "fp16":
            raise OptionError("the eager backend is the FP32 reference; precision='fp16' needs onnxruntime or "
                              "tensorrt")
        from mbert.runtime.eager import open_eager

        b = open_eager(bundle, source, "cpu" if kind in (None, "cpu") else f"cuda:{index}")
    check_graph_io(bundle, b.artifact, b.input_names, b.output_names)
    log.info("mbert.runtime: %s runs on %s (%s, %s)", bundle.path.name, b.name, b.artifact, b.precision)
    return b


def _int8_backend(name: str, kind: str | None) -> str:
    """model.int8.onnx runs on ONNX Runtime's CPU integer kernels (the ones it was validated on)."""
    if name not in ("auto", "onnxruntime", "onnxruntime-cpu"):
        raise OptionError(f"precision='int8' runs model.int8.onnx on ONNX Runtime CPU; backend {name!r} cannot "
                          "run it (use backend 'auto', 'onnxruntime' or 'onnxruntime-cpu')")
    if kind == "cuda":
        raise OptionError("precision='int8' runs on the CPU; device='cuda' contradicts it")
    return "onnxruntime-cpu"
