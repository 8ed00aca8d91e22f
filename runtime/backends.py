"""The runtime's backends behind one small interface.

* ``tensorrt``: the bundle's ``model.plan`` through :class:`mbert.runtime.tensorrt.TensorRTRunner`
  (FP16 as the plan was built), with the family that built it (TensorRT or TensorRT-RTX), where
  :func:`mbert.runtime.checks.can_run` allows it; a plan exported "built, not yet run" runs the
  parity grid on its first open on a GPU (:mod:`mbert.runtime.verdicts`). A TensorRT execution
  context is not thread-safe: calls are serialized with a lock (one context, so GPU memory does
  not grow with the number of threads).
* ``onnxruntime-cuda`` / ``onnxruntime-cpu``: ONNX Runtime. On CUDA the mixed-precision
  ``model.fp16.onnx`` by default, on CPU the FP32 ``model.onnx`` (``precision`` overrides);
  ``precision="int8"`` runs ``model.int8.onnx`` (dynamic INT8, ``--int8``) and only on the CPU.
  ``InferenceSession.run`` is thread-safe, so calls run concurrently.
* ``eager``: the PyTorch reference (``mbert.modeling.graph.GraphModule`` on the source checkpoint; a
  bundle holds no PyTorch weights). FP32 only. Forward passes of an eval module are thread-safe.

Every backend pads by the same rule (:func:`padded_length`): the longest row rounded up to a
multiple of 8, moved into the range of a TensorRT optimization profile when there are profiles.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from mbert.bundle import Bundle
from mbert.modeling.errors import BundleError, EngineError, OptionError

from . import checks
from .trt_family import current_gpu

log = logging.getLogger("mbert.runtime")
PAD_MULTIPLE = 8
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


def session_options(threads: int | None = None):
    """The ONNX Runtime session options of every session this project opens on a bundle graph (the
    runtime, the export's validation, the benchmarks' "ours").

    Memory-pattern planning is off. With it on, ONNX Runtime plans one block for all of a run's
    intermediates after the first run of a shape and keeps it next to its arena: at 1 x 8192 on
    full-size ModernBERT-base that took the peak RSS of a warm session from 1.85 to 2.98 GiB, at the
    same latency. What it buys is at small repeated shapes: 4 x 512 ran 4.09 s with it and 4.24 s
    without (median of 7 interleaved runs, same minimum); a server, which sees other shapes on most
    calls, gets less of it (README, "Measured").
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.enable_mem_pattern = False
    if threads:
        opts.intra_op_num_threads = threads
    return opts


def round_up(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def padded_length(seq: int, batch: int, max_seq: int, profiles: Sequence[Any] | None = None) -> int:
    """Length to pad a batch whose longest row has ``seq`` tokens: ``seq`` rounded up to a multiple of
    8, capped at ``max_seq``; with TensorRT profiles, the smallest such length some profile covering
    ``batch`` accepts (raised to the profile's minimum, capped at its maximum)."""
    if not profiles:
        return max(seq, min(round_up(seq), max_seq))
    best = None
    for p in profiles:
        if not p.min[0] <= batch <= p.max[0] or seq > p.max[1]:
            continue
        length = min(max(round_up(seq), p.min[1]), p.max[1])
        best = length if best is None else min(best, length)
    if best is None:
        listed = "; ".join(str(p) for p in profiles)
        raise EngineError(f"no optimization profile accepts batch {batch} x {seq} tokens (profiles: {listed})")
    return best


class _Padding:
    max_seq: int
    profiles: list | None = None

    @property
    def max_batch(self) -> int | None:
        return max(p.max[0] for p in self.profiles) if self.profiles else None

    def pad_to(self, seq: int, batch: int = 1) -> int:
        return padded_length(seq, batch, self.max_seq, self.profiles)


class OrtBackend(_Padding):
    def __init__(self, path: Path, max_seq: int, *, cuda: bool, precision: str, threads: int | None = None,
                 device_id: int = 0):
        import onnxruntime as ort

        opts = session_options(threads)
        providers: list = [("CUDAExecutionProvider", {"device_id": device_id})] if cuda else []
        providers.append("CPUExecutionProvider")
        self.session = ort.InferenceSession(str(path), opts, providers=providers)
        on_cuda = self.session.get_providers()[0] == "CUDAExecutionProvider"
        if cuda and not on_cuda:
            raise BundleError(f"ONNX Runtime could not use CUDA for {path.name} (no usable GPU?)")
        self.name = "onnxruntime-cuda" if on_cuda else "onnxruntime-cpu"
        self.precision, self.artifact, self.max_seq = precision, path.name, max_seq
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, input_ids, attention_mask, outputs=None):
        names = list(outputs) if outputs else self.output_names
        got = self.session.run(names, {"input_ids": input_ids, "attention_mask": attention_mask})
        return dict(zip(names, got))


class TensorRTBackend(_Padding):
    def __init__(self, plan: Path, max_seq: int, family: str, device_id: int = 0):
        from .tensorrt import TensorRTRunner, load_engine

        loaded = load_engine(plan, family=family)
        self.runner = TensorRTRunner(loaded, family=family, device=device_id)
        self.profiles = list(loaded.profiles)
        self.name, self.precision, self.artifact, self.max_seq = "tensorrt", "fp16", plan.name, max_seq
        self.input_names, self.output_names = list(loaded.input_names), list(loaded.output_names)
        self._lock = threading.Lock()

    def run(self, input_ids, attention_mask, outputs=None):
        with self._lock:
            got = self.runner.run_batch(input_ids, attention_mask)
        return {k: v for k, v in got.items() if not outputs or k in outputs}


class EagerBackend(_Padding):
    def __init__(self, graph_module, max_seq: int, artifact: str = "eager"):
        from mbert.modeling.graph import INPUT_NAMES, eager_runner

        self.runner = eager_runner(graph_module.eval())
        self.name, self.precision, self.artifact, self.max_seq = "eager", "fp32", artifact, max_seq
        self.input_names = list(INPUT_NAMES)
        self.output_names = list(graph_module.output_names)

    def run(self, input_ids, attention_mask, outputs=None):
        out = self.runner(input_ids, attention_mask)
        return {n: v for n, v in out.items() if not outputs or n in outputs}


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


def _ort_cuda_available() -> tuple[bool, str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return False, "onnxruntime is not installed (pip install 'mbert-export[cpu]' or '[gpu]')"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)"
    if current_gpu() is None:
        return False, "no CUDA GPU visible"
    return True, ""


def _trt_status(bundle: Bundle) -> tuple[bool, str]:
    engine = bundle.manifest.engine
    if engine is None:
        return False, f"the bundle has no model.plan (build one: mbert-export --engine-only {bundle.path})"
    gpu = current_gpu()
    ok, problems = checks.can_run(engine, gpu, bundle.path_of(engine.file, "engine.file"))
    if not ok:
        rebuild = f" (rebuild for this GPU: mbert-export --engine-only {bundle.path})" if gpu else ""
        return False, "; ".join(problems) + rebuild
    first = " (built, not yet run: the parity grid runs on first open)" if engine.validation is None else ""
    return True, f"runs {engine.file} with {engine.label}{first}"


def backend_statuses(bundle: Bundle, source: str | Path | None = None) -> list[BackendStatus]:
    """Which backends can run this bundle on this machine, and why not where they cannot."""
    m = bundle.manifest
    out = [BackendStatus("tensorrt", *_trt_status(bundle))]
    ok, why = _ort_cuda_available()
    fp16 = m.graph("fp16").file if m.graph("fp16") else f"{m.graph('fp32').file} (no FP16 graph in the bundle)"
    out.append(BackendStatus("onnxruntime-cuda", ok, f"runs {fp16}" if ok else why))
    try:
        import onnxruntime  # noqa: F401

        int8 = f"; {m.graph('int8').file} with precision int8" if m.graph("int8") else ""
        out.append(BackendStatus("onnxruntime-cpu", True, f"runs {m.graph('fp32').file} (FP32){int8}"))
    except ImportError:
        out.append(BackendStatus("onnxruntime-cpu", False, "onnxruntime is not installed"))
    try:
        where = checks.eager_source(bundle, source)
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
    (:mod:`mbert.runtime.verdicts`; default the user's cache folder)."""
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
            if checks.can_run(m.engine, current_gpu(index), bundle.path_of(m.engine.file, "engine.file"))[0]:
                name = "tensorrt"  # a plan that fails its first parity run is refused below, not skipped
        if name == "auto":
            name = "onnxruntime-cuda" if kind != "cpu" and _ort_cuda_available()[0] else "onnxruntime-cpu"
            if kind == "cuda" and name == "onnxruntime-cpu":
                raise BundleError(f"device {device!r} asked for, but neither TensorRT nor ONNX Runtime CUDA "
                                  f"can run here: {_ort_cuda_available()[1]}")
    elif name == "onnxruntime":
        name = "onnxruntime-cpu" if kind == "cpu" or not _ort_cuda_available()[0] else "onnxruntime-cuda"

    if name == "tensorrt":
        b: Backend = _open_tensorrt(bundle, precision, kind, index, verdict_cache)
    elif name.startswith("onnxruntime"):
        cuda = name == "onnxruntime-cuda"
        if cuda and not _ort_cuda_available()[0]:
            raise BundleError(f"ONNX Runtime CUDA cannot run here: {_ort_cuda_available()[1]}")
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
        from mbert.modeling.graph import GraphModule

        torch_device = "cpu" if kind in (None, "cpu") else f"cuda:{index}"
        model = checks.load_eager_model(bundle, source, device=torch_device)
        b = EagerBackend(GraphModule(model, m.pooling), max_seq, artifact=str(model.source.path))
    checks.check_graph_io(bundle, b.artifact, b.input_names, b.output_names)
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


def _open_tensorrt(bundle: Bundle, precision: str | None, kind: str | None, index: int,
                   verdict_cache: Path | None) -> "TensorRTBackend":
    engine = bundle.manifest.engine
    if precision == "fp32":
        raise OptionError("the TensorRT plan is FP16; use backend='onnxruntime' for precision='fp32'")
    if kind == "cpu":
        raise OptionError("TensorRT runs on a GPU; device='cpu' contradicts backend='tensorrt'")
    from .verdicts import first_open_check

    gpu = current_gpu(index)
    checks.check_engine(bundle, gpu)  # no engine, no GPU, or a plan this machine cannot run: refused
    assert engine is not None and gpu is not None
    b = TensorRTBackend(bundle.path_of(engine.file, "engine.file"), bundle.manifest.max_seq_len, engine.family, index)
    if tuple(b.profiles) != engine.profiles:
        raise BundleError(f"{bundle.path}: model.plan's optimization profiles {[str(p) for p in b.profiles]} are not "
                          f"the manifest's {[str(p) for p in engine.profiles]}; rebuild with: mbert-export "
                          f"--engine-only {bundle.path}")
    first_open_check(bundle, lambda ids, mask: b.run(ids, mask), gpu, cache_dir=verdict_cache)
    return b
