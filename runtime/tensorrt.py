"""Run TensorRT plans (TensorRT 10.x and 11.x): deserialize, pick the optimization profile per
shape, execute on a CUDA stream. Needs a GPU; ``tensorrt`` and ``torch`` CUDA are imported only
when a function needs them, so this module imports anywhere.

Running uses the name-based (enqueueV3) API of 10.x, unchanged in 11.x; nothing removed in 11.x
(``device_memory_size``, weak-typing flags, calibrators) is used. The exporter's builder
(``mbert.export.tensorrt``) shares the logger and the availability check defined here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mbert.bundle.manifest import Profile
from mbert.modeling.errors import EngineError

_log = logging.getLogger("mbert.tensorrt")
NOT_INSTALLED = ("tensorrt is not installed (pip install 'mbert-export[tensorrt]' on a machine "
                 "with NVIDIA's index reachable)")
# ILogger.Severity values (identical in 10.x and 11.x): INTERNAL_ERROR=0 ... VERBOSE=4.
_LEVELS = {"internal_error": 0, "error": 1, "warning": 2, "info": 3, "verbose": 4}
_PY_LEVELS = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO,
              4: logging.DEBUG}


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
        return False, NOT_INSTALLED
    except (ImportError, OSError) as exc:  # wheel present, libnvinfer*.so missing or broken
        return False, f"{NOT_INSTALLED}: {one_line(exc)}"
    try:
        builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    except Exception as exc:  # noqa: BLE001 - "CUDA initialization failure" surfaces as various
        return False, f"no CUDA GPU: {one_line(exc)}"
    if builder is None:
        return False, "no CUDA GPU: tensorrt.Builder could not be created"
    return True, ""


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
    trt = import_tensorrt()
    plan_path = Path(plan_path)
    if not plan_path.is_file():
        raise EngineError(f"engine plan not found: {plan_path}")
    logger = make_logger(trt, log_level)
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

def import_tensorrt() -> Any:
    ok, reason = tensorrt_available()
    if not ok:
        raise EngineError(reason)
    import tensorrt as trt  # noqa: PLC0415

    return trt


def make_logger(trt: Any, log_level: str) -> Any:
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
                self.errors.append(one_line(msg))
            if level <= threshold:
                _log.log(_PY_LEVELS.get(level, logging.DEBUG), "TensorRT: %s", msg)

    return _CapturingLogger()


def _torch_dtype(torch: Any, trt_dtype: Any) -> Any:
    name = getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])
    table = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
             "INT32": torch.int32, "INT64": torch.int64, "BOOL": torch.bool,
             "INT8": torch.int8, "UINT8": torch.uint8}
    if name not in table:
        raise EngineError(f"engine tensor type {name} is not supported by TensorRTRunner")
    return table[name]


def one_line(value: Any) -> str:
    return " ".join(str(value).split())

