"""Build TensorRT engines for exported ModernBERT bundles (TensorRT 10.x and 11.x).

This module imports neither ``tensorrt`` nor ``torch`` itself until a function needs them, so it
imports (and the CLI's ``--help`` works) on machines without TensorRT or a GPU. Running a plan is
the runtime's (``mbert.runtime.tensorrt``).

Build calls are identical in 10.x and 11.x (``Builder``, ``create_network``,
``OnnxParser.parse_from_file``, ``set_memory_pool_limit``, ``IOptimizationProfile.set_shape``,
``create_timing_cache`` / ``set_timing_cache``, ``build_serialized_network``), except that
``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` is requested, by name, on 10.x only: 11.x is
always strongly typed and has no EXPLICIT_BATCH.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from mbert.bundle.manifest import EngineRecord, Profile
from mbert.modeling.errors import EngineError
from mbert.runtime.tensorrt import import_tensorrt, make_logger, one_line, tensorrt_available

__all__ = ["profiles_from", "tensorrt_available", "build_engine"]

_log = logging.getLogger(__name__)
# Typical retrieval / classification inputs are at most this long (see profiles_from).
_SHORT_TEXT = 512


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


def build_engine(onnx_path: str | Path, plan_path: str | Path, profiles: Iterable[Profile],
                 *, workspace_gib: float = 4.0, timing_cache_path: str | Path | None = None,
                 builder_optimization_level: int = 3, log_level: str = "warning") -> EngineRecord:
    """Build a strongly typed engine from an ONNX file and write it atomically to ``plan_path``.

    Precision comes from the ONNX graph (FP16 tensors and Casts); TF32 is disabled so FP32 regions
    stay FP32. Every profile is applied to every network input. The timing cache, when a path is
    given, is read if present and written back after the build. Returns the manifest's engine
    record (not yet validated). Valid for TensorRT 10.x and 11.x; raises EngineError on any failure.
    """
    trt = import_tensorrt()
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    profiles = list(profiles)
    if not profiles:
        raise EngineError("build_engine needs at least one optimization profile")
    if not onnx_path.is_file():
        raise EngineError(f"ONNX file not found: {onnx_path}")
    logger = make_logger(trt, log_level)
    try:
        builder = trt.Builder(logger)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"cannot start the TensorRT builder (no CUDA GPU?): {one_line(exc)}") \
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
    return EngineRecord(file=plan_path.name, onnx=onnx_path.name, tensorrt_version=str(trt.__version__),
                        gpu_name=gpu_name, compute_capability=capability, profiles=tuple(profiles),
                        workspace_gib=float(workspace_gib), builder_optimization_level=int(builder_optimization_level),
                        build_seconds=round(build_seconds, 3), validation=None)


# --- helpers -------------------------------------------------------------------------------------

def _major_version(trt: Any) -> int:
    try:
        return int(str(trt.__version__).split(".")[0])
    except ValueError as exc:
        raise EngineError(f"unrecognised TensorRT version {trt.__version__!r}") from exc


def _parser_error(error: Any) -> str:
    """One parser error verbatim, prefixed by ONNX node name and operator where the binding has
    ``node_name()`` / ``node_operator()`` (10.x+), else by the node index."""
    desc = one_line(error.desc())
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


