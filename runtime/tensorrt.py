"""Run a TensorRT or TensorRT-RTX plan on a CUDA GPU: deserialize, pick the optimization profile per
shape, execute on a CUDA stream; and TensorRT-RTX's own check of whether a plan can run here.

Needs the family's module and a CUDA GPU (buffers are torch CUDA tensors); nothing here runs on a
machine without one, and nothing imports TensorRT until a function needs it. The calls are the
name-based (enqueueV3) API, identical in TensorRT 10.x, 11.x and TensorRT-RTX 1.x:
``Runtime.deserialize_cuda_engine``, ``create_execution_context``, ``set_optimization_profile_async``,
``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``; nothing removed in 11.x
(``device_memory_size``, weak-typing flags, calibrators) is used. Families, versions and the shared
logger: :mod:`mbert.runtime.trt_family`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mbert.bundle.engine import LABELS, Profile
from mbert.modeling.errors import EngineError

from .trt_family import family_logger, import_family

__all__ = ["LoadedEngine", "load_engine", "TensorRTRunner", "select_profile", "rtx_plan_validity"]


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
    if not plan_path.is_file():
        raise EngineError(f"engine plan not found: {plan_path}")
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
    """One execution context on one CUDA stream; buffers are torch CUDA tensors.

    ``run(input_ids=..., attention_mask=...)`` picks the optimization profile whose range contains
    the (batch, seq) shape, runs the engine and returns ``{output name: numpy array}`` (floating
    outputs as float32). Not thread-safe: use one runner per thread.
    """

    def __init__(self, plan: str | Path | LoadedEngine, *, family: str, device: int = 0) -> None:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise EngineError("TensorRTRunner needs a CUDA build of torch and a visible GPU")
        self._torch = torch
        self.device = torch.device("cuda", device)
        self.loaded = plan if isinstance(plan, LoadedEngine) else load_engine(plan, family=family)
        self.engine = self.loaded.engine
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise EngineError("TensorRT could not create an execution context (out of GPU memory?)")
        self.stream = torch.cuda.Stream(device=self.device)
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


def rtx_plan_validity(plan: bytes | Path) -> list[str]:
    """TensorRT-RTX's header check of a plan on this machine (``Runtime.get_engine_validity``):
    empty when VALID or SUBOPTIMAL, else the reasons it reports. Without a GPU it always answers
    INVALID (measured with 1.7.1), so call it only where a GPU is present."""
    trt = import_family("tensorrt-rtx")
    blob = Path(plan).read_bytes() if isinstance(plan, (str, Path)) else plan
    runtime = trt.Runtime(family_logger(trt))
    validity, diagnostics = runtime.get_engine_validity(blob)
    if validity != trt.EngineValidity.INVALID:
        return []
    flags = [name for name, member in trt.EngineInvalidityDiagnostics.__members__.items()
             if int(diagnostics) & int(member)]
    return [f"TensorRT-RTX's validity check says INVALID ({', '.join(flags) or 'no diagnostics given'})"]


def _torch_dtype(torch: Any, trt_dtype: Any) -> Any:
    name = getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])
    table = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
             "INT32": torch.int32, "INT64": torch.int64, "BOOL": torch.bool,
             "INT8": torch.int8, "UINT8": torch.uint8}
    if name not in table:
        raise EngineError(f"engine tensor type {name} is not supported by TensorRTRunner")
    return table[name]
