"""Run a TensorRT or TensorRT-RTX plan on a CUDA GPU: deserialize, pick the optimization profile per
shape, execute on a CUDA stream; TensorRT-RTX's own check of whether a plan can run here; and the
TensorRT backend of the runtime.

Needs the family's module and a CUDA GPU; device memory, copies and the stream go through the CUDA
*driver* API of cuda-python (``cuda.bindings.driver``: it needs only the NVIDIA driver, no CUDA
toolkit and no torch, so a serving install carries no training framework). Nothing here runs on a
machine without a GPU (running an engine is not tested on the build machines, which have none), and
nothing imports TensorRT or cuda-python until a function needs it. The calls are the
name-based (enqueueV3) API, identical in TensorRT 10.x, 11.x and TensorRT-RTX 1.x:
``Runtime.deserialize_cuda_engine``, ``create_execution_context``, ``set_optimization_profile_async``,
``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``; nothing removed in 11.x
(``device_memory_size``, weak-typing flags, calibrators) is used. Families, versions and the shared
logger: :mod:`mbert.runtime.backends.family`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mbert.bundle import Bundle
from mbert.bundle.engine import LABELS, Profile
from mbert.bundle.errors import BundleError, EngineError, OptionError
from mbert.bundle.files import check_regular
from mbert.runtime.backends.cuda import CudaDevice
from mbert.runtime.backends.family import family_logger, import_family
from mbert.runtime.text import Padding

__all__ = ["LoadedEngine", "load_engine", "TensorRTRunner", "TensorRTBackend", "open_tensorrt", "select_profile"]


def select_profile(profiles: Sequence[Profile], batch: int, seq: int) -> int:
    """Index of the first profile whose range contains (batch, seq); EngineError if none does."""
    for index, profile in enumerate(profiles):
        if profile.covers(batch, seq):
            return index
    listed = "; ".join(f"#{i}: {p}" for i, p in enumerate(profiles)) or "none"
    raise EngineError(f"no optimization profile covers input shape (batch={batch}, seq={seq}); "
                      f"the engine's profiles are {listed}")


@dataclass
class LoadedEngine:
    """A deserialized engine with the runtime and logger that must outlive it."""

    engine: Any
    runtime: Any
    logger: Any
    input_names: list[str]
    output_names: list[str]
    profiles: list[Profile]
    family: str


def load_engine(plan_path: str | Path, *, family: str) -> LoadedEngine:
    """Deserialize a plan with ``family``'s runtime and read its I/O tensor names and optimization
    profiles back from the engine."""
    trt = import_family(family)
    plan_path = Path(plan_path)
    check_regular(plan_path, EngineError, "engine plan")
    logger = family_logger(trt)
    runtime = trt.Runtime(logger)
    with logger.capture(1) as errors:
        engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
    if engine is None:
        raise EngineError(f"{LABELS[family]} {trt.__version__} cannot load {plan_path} (plans run only with the "
                          "release and on the GPUs they were built for): "
                          + ("; ".join(m for _, m in errors[-3:]) or "no error was logged"))
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
    profiles = []
    for index in range(engine.num_optimization_profiles):
        shapes = [engine.get_tensor_profile_shape(n, index) for n in inputs]
        # every input got the same ranges at build time; intersect to be safe
        lo = tuple(max(int(s[0][d]) for s in shapes) for d in range(2))
        hi = tuple(min(int(s[2][d]) for s in shapes) for d in range(2))
        opt = tuple(min(max(int(shapes[0][1][d]), lo[d]), hi[d]) for d in range(2))
        profiles.append(Profile(lo, opt, hi))
    return LoadedEngine(engine, runtime, logger, inputs, outputs, profiles, family)


class TensorRTRunner:
    """One execution context on one CUDA stream of the device's primary context (the one TensorRT
    uses), with device buffers kept between calls and grown when a larger shape comes.

    ``run(input_ids=..., attention_mask=...)`` picks the optimization profile whose range contains
    the (batch, seq) shape, runs the engine and returns ``{output name: numpy array}`` (floating
    outputs as float32). Not thread-safe: use one runner per thread (the backend serializes calls).
    """

    def __init__(self, plan: str | Path | LoadedEngine, *, family: str, device: int = 0) -> None:
        self.cuda = CudaDevice(device)
        self.loaded = plan if isinstance(plan, LoadedEngine) else load_engine(plan, family=family)
        self.engine = self.loaded.engine
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise EngineError("TensorRT could not create an execution context (out of GPU memory?)")
        kinds = {n: self.engine.get_tensor_dtype(n) for n in self.loaded.input_names + self.loaded.output_names}
        self._dtypes = {n: numpy_dtype(k) for n, k in kinds.items()}
        self._bf16 = {n for n, k in kinds.items() if _type_name(k) == "BF16"}
        self._profile: int | None = None

    @property
    def profiles(self) -> list[Profile]:
        return self.loaded.profiles

    def run_batch(self, input_ids: Any, attention_mask: Any) -> dict[str, Any]:
        """:meth:`run` on a batch of any size: rows in chunks of the largest batch a profile covering
        the sequence length accepts (the validation grid has batches larger than small profiles)."""
        import numpy as np  # noqa: PLC0415

        batch, seq = np.shape(input_ids)
        limit = max((p.max[0] for p in self.profiles if p.min[1] <= seq <= p.max[1]), default=batch)
        parts = [self.run(input_ids=input_ids[i:i + limit], attention_mask=attention_mask[i:i + limit])
                 for i in range(0, batch, limit)]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def run(self, **inputs: Any) -> dict[str, Any]:
        import numpy as np  # noqa: PLC0415

        missing = sorted(set(self.loaded.input_names) - set(inputs))
        if missing:
            raise EngineError(f"missing engine inputs: {', '.join(missing)}")
        arrays = {n: np.ascontiguousarray(inputs[n], dtype=self._dtypes[n]) for n in self.loaded.input_names}
        shapes = {a.shape for a in arrays.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise EngineError(f"inputs must share one [batch, sequence] shape, got "
                              f"{ {n: a.shape for n, a in arrays.items()} }")
        batch, seq = next(iter(shapes))
        index = select_profile(self.profiles, batch, seq)
        ctx, cuda = self.context, self.cuda
        cuda.make_current()
        if index != self._profile:
            if not ctx.set_optimization_profile_async(index, cuda.stream):
                raise EngineError(f"TensorRT refused optimization profile {index}")
            self._profile = index
        for name, array in arrays.items():
            if not ctx.set_input_shape(name, (batch, seq)):
                raise EngineError(f"TensorRT refused shape {(batch, seq)} for {name!r}")
            ctx.set_tensor_address(name, cuda.upload(name, array))
        results = {}
        for name in self.loaded.output_names:
            shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise EngineError(f"output {name!r} has unresolved shape {shape}")
            results[name] = np.empty(shape, dtype=self._dtypes[name])
            ctx.set_tensor_address(name, cuda.buffer(name, results[name].nbytes))
        if not ctx.execute_async_v3(cuda.stream):
            raise EngineError(f"TensorRT execution failed for shape (batch={batch}, "
                              f"seq={seq}): " + "; ".join(self.loaded.logger.errors[-3:]))
        for name, host in results.items():
            cuda.download(name, host)
        cuda.synchronize()  # the host arrays (inputs and outputs) stay alive until here
        return {name: as_float32(host, name in self._bf16) for name, host in results.items()}


# TensorRT tensor types as numpy dtypes; BF16 has no numpy type: it is read as its raw 16 bits.
_NUMPY = {"FLOAT": "float32", "HALF": "float16", "BF16": "uint16", "INT32": "int32", "INT64": "int64",
          "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}


def _type_name(trt_dtype: Any) -> str:
    return getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])


def numpy_dtype(trt_dtype: Any) -> Any:
    import numpy as np  # noqa: PLC0415

    name = _type_name(trt_dtype)
    if name not in _NUMPY:
        raise EngineError(f"engine tensor type {name} is not supported by TensorRTRunner")
    return np.dtype(_NUMPY[name])


def as_float32(array: Any, bf16: bool = False) -> Any:
    """Floating outputs as float32 (``bf16``: ``array`` holds BF16 bits, widened); others unchanged."""
    import numpy as np  # noqa: PLC0415

    if bf16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32) if array.dtype.kind == "f" else array


class TensorRTBackend(Padding):
    """The bundle's plan: FP16 as built. An execution context is not thread-safe, so calls are serialized
    with a lock (one context: GPU memory does not grow with the number of threads)."""

    def __init__(self, plan: Path, max_seq: int, family: str, device_id: int = 0):
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




def open_tensorrt(bundle: Bundle, precision: str | None, kind: str | None, index: int,
                   verdict_cache: Path | None) -> "TensorRTBackend":
    engine = bundle.manifest.engine
    if precision == "fp32":
        raise OptionError("the TensorRT plan is FP16; use backend='onnxruntime' for precision='fp32'")
    if kind == "cpu":
        raise OptionError("TensorRT runs on a GPU; device='cpu' contradicts backend='tensorrt'")
    from mbert.runtime.backends.checks import check_engine
    from mbert.runtime.backends.cuda import current_gpu
    from mbert.runtime.backends.verdicts import first_open_check

    gpu = current_gpu(index)
    check_engine(bundle, gpu)  # no engine, no GPU, or a plan this machine cannot run: refused
    assert engine is not None and gpu is not None
    b = TensorRTBackend(bundle.path_of(engine.file, "engine.file"), bundle.manifest.max_seq_len, engine.family, index)
    if tuple(b.profiles) != engine.profiles:
        raise BundleError(f"{bundle.path}: model.plan's optimization profiles {[str(p) for p in b.profiles]} are not "
                          f"the manifest's {[str(p) for p in engine.profiles]}; rebuild with: mbert-export "
                          f"--engine-only {bundle.path}")
    first_open_check(bundle, lambda ids, mask: b.run(ids, mask), gpu, cache_dir=verdict_cache)
    return b
