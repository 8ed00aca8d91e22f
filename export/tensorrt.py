"""Build and run TensorRT engines for exported ModernBERT bundles (TensorRT 10.x and 11.x).

This module imports neither ``tensorrt`` nor ``torch`` itself until a function needs them, so it
imports (and the CLI's ``--help`` works) on machines without TensorRT or a GPU.

Build calls are identical in 10.x and 11.x (``Builder``, ``create_network``,
``OnnxParser.parse_from_file``, ``set_memory_pool_limit``, ``IOptimizationProfile.set_shape``,
``create_timing_cache`` / ``set_timing_cache``, ``build_serialized_network``), except that
``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` is requested, by name, on 10.x only: 11.x is
always strongly typed and has no EXPLICIT_BATCH. Running uses the name-based (enqueueV3) API of
10.x, unchanged in 11.x; nothing removed in 11.x (``device_memory_size``, weak-typing flags,
calibrators) is used.
"""
from __future__ import annotations

import logging
import operator
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from mbert.modeling.errors import EngineError

__all__ = [
    "Profile", "profiles_from", "select_profile", "tensorrt_available", "build_engine",
    "load_engine", "LoadedEngine", "TensorRTRunner",
]

_log = logging.getLogger(__name__)
_NOT_INSTALLED = ("tensorrt is not installed (pip install 'mbert-export[tensorrt]' on a machine "
                  "with NVIDIA's index reachable)")
# ILogger.Severity values (identical in 10.x and 11.x): INTERNAL_ERROR=0 ... VERBOSE=4.
_LEVELS = {"internal_error": 0, "error": 1, "warning": 2, "info": 3, "verbose": 4}
_PY_LEVELS = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO,
              4: logging.DEBUG}
# Typical retrieval / classification inputs are at most this long (see profiles_from).
_SHORT_TEXT = 512


@dataclass(frozen=True)
class Profile:
    """One optimization profile: (batch, sequence) shapes for every network input."""

    min: tuple[int, int]
    opt: tuple[int, int]
    max: tuple[int, int]

    def __post_init__(self) -> None:
        for name in ("min", "opt", "max"):
            value = getattr(self, name)
            try:
                if isinstance(value, (str, bytes)) or len(value) != 2 \
                        or any(isinstance(v, bool) for v in value):
                    raise TypeError
                pair = (operator.index(value[0]), operator.index(value[1]))
            except TypeError:
                raise EngineError(f"profile {name} must be a (batch, sequence) pair of ints, "
                                  f"got {value!r}") from None
            object.__setattr__(self, name, pair)
        for axis, label in ((0, "batch"), (1, "sequence")):
            lo, mid, hi = self.min[axis], self.opt[axis], self.max[axis]
            if not 1 <= lo <= mid <= hi:
                raise EngineError(f"profile {label} sizes must satisfy 1 <= min <= opt <= max, "
                                  f"got min={lo} opt={mid} max={hi}")

    def covers(self, batch: int, seq: int) -> bool:
        """True when a (batch, seq) input lies inside this profile's range."""
        return (self.min[0] <= batch <= self.max[0]) and (self.min[1] <= seq <= self.max[1])

    def as_lists(self) -> dict[str, list[int]]:
        """JSON form used in manifests: ``{"min": [b, s], "opt": [...], "max": [...]}``."""
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}

    @classmethod
    def from_any(cls, value: "Profile | dict[str, Sequence[int]]") -> "Profile":
        """Accept a Profile or its ``as_lists()`` form (as read back from a manifest)."""
        if isinstance(value, Profile):
            return value
        try:
            return cls(tuple(value["min"]), tuple(value["opt"]), tuple(value["max"]))
        except (KeyError, TypeError) as exc:
            raise EngineError(f"not an optimization profile: {value!r}") from exc

    def __str__(self) -> str:
        return f"min={self.min} opt={self.opt} max={self.max}"


def profiles_from(max_batch: int, max_seq_len: int, opt_batch: int | None = None,
                  opt_seq_len: int | None = None,
                  split_seq: list[int] | None = None) -> list[Profile]:
    """Optimization profiles covering batch 1..max_batch and sequence 1..max_seq_len.

    One profile by default. ``split_seq`` (e.g. ``[512, 8192]``) gives one profile per contiguous
    sequence range (1..512, 513..8192): each is tuned separately, so short requests get kernels
    chosen for short shapes instead of ones timed on long sequences. A last boundary below
    ``max_seq_len`` is extended with ``max_seq_len``.

    Defaults for the shape TensorRT times kernels at (``opt``; every shape in range still runs):

    * batch: ``max(1, max_batch // 2)``. Under load Triton's dynamic batcher fills batches, at low
      load they are small; the midpoint keeps tactics reasonable for both ends.
    * sequence: 512 (typical passage / query length, the length most retrieval and
      classification traffic stays under) when the range reaches down to it, clamped to the range;
      a range wholly above 512 (the long profile of a split) is tuned at its midpoint.
    ``opt_seq_len`` when given is clamped into every range.
    """
    for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise EngineError(f"{name} must be a positive int, got {value!r}")
    if opt_batch is None:
        opt_batch = max(1, max_batch // 2)
    if not 1 <= opt_batch <= max_batch:
        raise EngineError(f"opt_batch must be in 1..{max_batch}, got {opt_batch}")
    if opt_seq_len is not None and not 1 <= opt_seq_len <= max_seq_len:
        raise EngineError(f"opt_seq_len must be in 1..{max_seq_len}, got {opt_seq_len}")
    bounds = sorted(set(split_seq or []))
    if split_seq and (list(split_seq) != bounds or bounds[0] < 1):
        raise EngineError(f"split_seq must be strictly increasing positive ints, got {split_seq}")
    if bounds and bounds[-1] > max_seq_len:
        raise EngineError(f"split_seq {split_seq} goes beyond max_seq_len {max_seq_len}")
    if not bounds or bounds[-1] < max_seq_len:
        bounds.append(max_seq_len)
    profiles, lo = [], 1
    for hi in bounds:
        if opt_seq_len is not None:
            opt_seq = min(max(opt_seq_len, lo), hi)
        elif lo <= _SHORT_TEXT:
            opt_seq = min(hi, _SHORT_TEXT)
        else:
            opt_seq = max(lo, hi // 2)
        profiles.append(Profile((1, lo), (opt_batch, opt_seq), (max_batch, hi)))
        lo = hi + 1
    return profiles


def select_profile(profiles: Sequence[Profile], batch: int, seq: int) -> int:
    """Index of the first profile whose range contains (batch, seq); EngineError if none does."""
    for index, profile in enumerate(profiles):
        if profile.covers(batch, seq):
            return index
    listed = "; ".join(f"#{i}: {p}" for i, p in enumerate(profiles)) or "none"
    raise EngineError(f"no optimization profile covers input shape (batch={batch}, seq={seq}); "
                      f"the engine's profiles are {listed}")


def tensorrt_available() -> tuple[bool, str]:
    """``(True, "")`` when TensorRT imports and a builder can start on a CUDA GPU, else
    ``(False, one-line reason)``. Valid for 10.x and 11.x."""
    try:
        import tensorrt as trt  # noqa: PLC0415 - deliberately lazy
    except ModuleNotFoundError:
        return False, _NOT_INSTALLED
    except (ImportError, OSError) as exc:  # wheel present, libnvinfer*.so missing or broken
        return False, f"{_NOT_INSTALLED}: {_one_line(exc)}"
    try:
        builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    except Exception as exc:  # noqa: BLE001 - "CUDA initialization failure" surfaces as various
        return False, f"no CUDA GPU: {_one_line(exc)}"
    if builder is None:
        return False, "no CUDA GPU: tensorrt.Builder could not be created"
    return True, ""


def build_engine(onnx_path: str | Path, plan_path: str | Path, profiles: Iterable[Profile],
                 *, workspace_gib: float = 4.0, timing_cache_path: str | Path | None = None,
                 builder_optimization_level: int = 3, log_level: str = "warning") -> dict[str, Any]:
    """Build a strongly typed engine from an ONNX file and write it atomically to ``plan_path``.

    Precision comes from the ONNX graph (FP16 tensors and Casts); TF32 is disabled so FP32 regions
    stay FP32. Every profile is applied to every network input. The timing cache, when a path is
    given, is read if present and written back after the build. Returns the manifest's engine
    record. Valid for TensorRT 10.x and 11.x; raises EngineError on any failure.
    """
    trt = _import_tensorrt()
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    profiles = [Profile.from_any(p) for p in profiles]
    if not profiles:
        raise EngineError("build_engine needs at least one optimization profile")
    if not onnx_path.is_file():
        raise EngineError(f"ONNX file not found: {onnx_path}")
    logger = _make_logger(trt, log_level)
    try:
        builder = trt.Builder(logger)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"cannot start the TensorRT builder (no CUDA GPU?): {_one_line(exc)}") \
            from exc
    major = _major_version(trt)
    flags = 0
    if major == 10:
        strong = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        if strong is None:
            raise EngineError(f"TensorRT {trt.__version__} has no STRONGLY_TYPED networks; "
                              "upgrade to 10.12 or newer")
        flags |= 1 << int(strong)
    elif major < 10:
        raise EngineError(f"TensorRT {trt.__version__} is too old: 10.x or newer is required")
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineError(f"TensorRT's ONNX parser rejected {onnx_path} ({len(errors)} error(s)): "
                          + " | ".join(errors or logger.errors or ["no error reported"]))

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    if hasattr(config, "builder_optimization_level"):
        config.builder_optimization_level = int(builder_optimization_level)
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    for tensor in inputs:
        if len(tuple(tensor.shape)) != 2:
            raise EngineError(f"network input {tensor.name!r} has shape {tuple(tensor.shape)}; "
                              "expected [batch, sequence]")
    for profile in profiles:
        opt_profile = builder.create_optimization_profile()
        for tensor in inputs:
            opt_profile.set_shape(tensor.name, profile.min, profile.opt, profile.max)
        if config.add_optimization_profile(opt_profile) < 0:
            raise EngineError(f"TensorRT rejected optimization profile {profile}: "
                              + "; ".join(logger.errors or ["no error reported"]))

    cache_path = Path(timing_cache_path) if timing_cache_path is not None else None
    if cache_path is not None:
        saved = cache_path.read_bytes() if cache_path.is_file() else b""
        cache = config.create_timing_cache(saved)
        if not config.set_timing_cache(cache, ignore_mismatch=False):
            _log.warning("timing cache %s was made for another device or version; starting a "
                         "new one", cache_path)
            config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)

    started = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    build_seconds = time.perf_counter() - started
    if plan is None:
        raise EngineError(f"TensorRT could not build an engine from {onnx_path}: "
                          + "; ".join(logger.errors or ["no error was logged"]))
    _atomic_write(plan_path, plan)
    if cache_path is not None:
        _atomic_write(cache_path, config.get_timing_cache().serialize())
    gpu_name, capability = _gpu_info()
    return {
        "tensorrt_version": str(trt.__version__),
        "gpu_name": gpu_name,
        "compute_capability": capability,
        "profiles": [p.as_lists() for p in profiles],
        "workspace_gib": float(workspace_gib),
        "builder_optimization_level": int(builder_optimization_level),
        "build_seconds": round(build_seconds, 3),
        "onnx": onnx_path.name,
        "plan": plan_path.name,
        "strongly_typed": True,
    }


@dataclass
class LoadedEngine:
    """A deserialized engine with the runtime and logger that must outlive it."""

    engine: Any
    runtime: Any
    logger: Any
    input_names: list[str]
    output_names: list[str]
    profiles: list[Profile] = field(default_factory=list)


def load_engine(plan_path: str | Path, *, log_level: str = "warning") -> LoadedEngine:
    """Deserialize a plan (TensorRT 10.x/11.x ``Runtime.deserialize_cuda_engine``) and read its
    I/O tensor names and optimization profiles back from the engine."""
    trt = _import_tensorrt()
    plan_path = Path(plan_path)
    if not plan_path.is_file():
        raise EngineError(f"engine plan not found: {plan_path}")
    logger = _make_logger(trt, log_level)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
    if engine is None:
        raise EngineError(f"TensorRT {trt.__version__} cannot load {plan_path} (plans run only on "
                          "the TensorRT version and GPU architecture that built them): "
                          + "; ".join(logger.errors or ["no error was logged"]))
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
    return LoadedEngine(engine, runtime, logger, inputs, outputs, profiles)


class TensorRTRunner:
    """One execution context on one CUDA stream; buffers are torch CUDA tensors.

    ``run(input_ids=..., attention_mask=...)`` picks the optimization profile whose range contains
    the (batch, seq) shape, runs the engine and returns ``{output name: numpy array}`` (floating
    outputs as float32). Not thread-safe: use one runner per thread.
    """

    def __init__(self, plan: str | Path | LoadedEngine, *, device: int = 0) -> None:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise EngineError("TensorRTRunner needs a CUDA build of torch and a visible GPU")
        self._torch = torch
        self.device = torch.device("cuda", device)
        self.loaded = plan if isinstance(plan, LoadedEngine) else load_engine(plan)
        self.engine = self.loaded.engine
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise EngineError("TensorRT could not create an execution context (out of GPU memory?)")
        self.stream = torch.cuda.Stream(device=self.device)
        self._profile: int | None = None

    @property
    def profiles(self) -> list[Profile]:
        return self.loaded.profiles

    def run(self, **inputs: Any) -> dict[str, Any]:
        import numpy as np  # noqa: PLC0415

        torch = self._torch
        missing = sorted(set(self.loaded.input_names) - set(inputs))
        if missing:
            raise EngineError(f"missing engine inputs: {', '.join(missing)}")
        arrays = {n: np.asarray(inputs[n]) for n in self.loaded.input_names}
        shapes = {a.shape for a in arrays.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise EngineError(f"inputs must share one [batch, sequence] shape, got "
                              f"{ {n: a.shape for n, a in arrays.items()} }")
        batch, seq = next(iter(shapes))
        index = select_profile(self.profiles, batch, seq)
        ctx, stream = self.context, self.stream
        buffers: dict[str, Any] = {}
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if index != self._profile:
                if not ctx.set_optimization_profile_async(index, stream.cuda_stream):
                    raise EngineError(f"TensorRT refused optimization profile {index}")
                self._profile = index
            for name, array in arrays.items():
                dtype = _torch_dtype(torch, self.engine.get_tensor_dtype(name))
                buffers[name] = torch.from_numpy(np.ascontiguousarray(array)).to(
                    self.device, dtype=dtype)
                if not ctx.set_input_shape(name, (batch, seq)):
                    raise EngineError(f"TensorRT refused shape {(batch, seq)} for {name!r}")
            for name in self.loaded.output_names:
                shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise EngineError(f"output {name!r} has unresolved shape {shape}")
                dtype = _torch_dtype(torch, self.engine.get_tensor_dtype(name))
                buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
            for name, tensor in buffers.items():
                ctx.set_tensor_address(name, tensor.data_ptr())
            if not ctx.execute_async_v3(stream.cuda_stream):
                raise EngineError(f"TensorRT execution failed for shape (batch={batch}, "
                                  f"seq={seq}): " + "; ".join(self.loaded.logger.errors[-3:]))
        stream.synchronize()
        result = {}
        for name in self.loaded.output_names:
            tensor = buffers[name]
            if tensor.is_floating_point():
                tensor = tensor.float()
            result[name] = tensor.cpu().numpy()
        return result


# --- helpers -------------------------------------------------------------------------------------

def _import_tensorrt() -> Any:
    ok, reason = tensorrt_available()
    if not ok:
        raise EngineError(reason)
    import tensorrt as trt  # noqa: PLC0415

    return trt


def _major_version(trt: Any) -> int:
    try:
        return int(str(trt.__version__).split(".")[0])
    except ValueError as exc:
        raise EngineError(f"unrecognised TensorRT version {trt.__version__!r}") from exc


def _make_logger(trt: Any, log_level: str) -> Any:
    """A ``trt.ILogger`` subclass (10.x/11.x) that forwards to ``logging`` at ``log_level`` and
    keeps every ERROR / INTERNAL_ERROR message for error reports."""
    try:
        threshold = _LEVELS[log_level.lower()]
    except (KeyError, AttributeError):
        raise EngineError(f"log_level must be one of {', '.join(_LEVELS)}, got {log_level!r}") \
            from None

    class _CapturingLogger(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            if level <= 1:
                self.errors.append(_one_line(msg))
            if level <= threshold:
                _log.log(_PY_LEVELS.get(level, logging.DEBUG), "TensorRT: %s", msg)

    return _CapturingLogger()


def _parser_error(error: Any) -> str:
    """One parser error verbatim, prefixed by ONNX node name and operator where the binding has
    ``node_name()`` / ``node_operator()`` (10.x+), else by the node index."""
    desc = _one_line(error.desc())
    where = []
    for attr in ("node_name", "node_operator"):
        getter = getattr(error, attr, None)
        value = getter() if callable(getter) else None
        if value:
            where.append(str(value))
    if not where and callable(getattr(error, "node", None)) and error.node() >= 0:
        where.append(f"node #{error.node()}")
    code = getattr(error, "code", None)
    parts = [f"[{' '.join(where)}]"] if where else []
    if callable(code):
        parts.append(f"{code()}:")
    return " ".join(parts + [desc])


def _atomic_write(path: Path, data: Any) -> None:
    """Write bytes (or any buffer, e.g. ``IHostMemory``) via a temp file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(memoryview(data))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _gpu_info() -> tuple[str, str]:
    """(GPU name, "9.0"-style compute capability) of the current device: cuda-python first
    (``cuda.bindings.runtime``, or ``cuda.cudart`` before cuda-python 12.6), then torch."""
    for module in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            cudart = __import__(module, fromlist=["_"])
            err, device = cudart.cudaGetDevice()
            if int(err) != 0:
                continue
            err, prop = cudart.cudaGetDeviceProperties(device)
            if int(err) != 0:
                continue
            name = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else prop.name
            return str(name).rstrip("\x00").strip(), f"{prop.major}.{prop.minor}"
        except Exception:  # noqa: BLE001 - absent or unusable: try the next source
            continue
    try:
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return torch.cuda.get_device_name(), f"{major}.{minor}"
    except Exception:  # noqa: BLE001
        pass
    return "unknown", "unknown"


def _torch_dtype(torch: Any, trt_dtype: Any) -> Any:
    name = getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])
    table = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
             "INT32": torch.int32, "INT64": torch.int64, "BOOL": torch.bool,
             "INT8": torch.int8, "UINT8": torch.uint8}
    if name not in table:
        raise EngineError(f"engine tensor type {name} is not supported by TensorRTRunner")
    return table[name]


def _one_line(value: Any) -> str:
    return " ".join(str(value).split())

