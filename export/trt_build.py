"""Build a TensorRT or TensorRT-RTX engine from an ONNX graph: one builder API for both families.

``build_engine(onnx, plan, profiles, family="auto" | "tensorrt" | "tensorrt-rtx", ...)`` returns the
:class:`~mbert.runtime.trt_record.EngineRecord` of the plan it wrote. What each family gets:

* both: a strongly typed network (precision comes from the graph's types and Casts: TensorRT 10.x
  asks for ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``, 11.x and TensorRT-RTX always are),
  TF32 off (FP32 regions stay FP32), the workspace limit, the builder optimization level, every
  optimization profile applied to every network input.
* datacenter TensorRT: the optional timing cache (read if present, written after the build) and
  the optional hardware-compatibility level AMPERE_PLUS; the record names the GPU it was built on
  (its builder cannot start without one).
* TensorRT-RTX: compute-capability targets (``config.num_compute_capabilities``,
  ``config.set_compute_capability(ComputeCapability.SMxy, i)``; default the portable set 8.0, 8.6,
  8.9, 12.0); no timing cache (it forces a GPU query and has no effect on an RTX plan: TensorRT-RTX
  1.1 release notes); builds with no GPU at all.

Building needs only the builder; the plan may be unable to run here (TensorRT-RTX on a machine
without a GPU): the record then says "built, not yet run" and why. The builder's log is captured
at VERBOSE and its informative lines (warnings, engine layer information, Myelin and attention
fusion) are written next to the plan when ``log_path`` is given.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from mbert.modeling.errors import EngineError
from mbert.runtime.trt_compat import PORTABLE_CAPABILITIES, can_run
from mbert.runtime.trt_family import (
    LABELS, Gpu, builder_available, current_gpu, family_logger, import_family, one_line, parse_capability,
    resolve_family,
)
from mbert.runtime.trt_profiles import Profile
from mbert.runtime.trt_record import BuilderOptions, EngineRecord

__all__ = ["ParsedNetwork", "network_flags", "parse_onnx", "build_engine", "build_parsed", "build_log_text",
           "tensorrt_verdict", "BUILD_LOG_TOPICS"]

# Builder log lines worth keeping beside the plan (besides every warning and error): what the
# engine became and whether attention was fused. Matched as substrings of TensorRT's log text.
BUILD_LOG_TOPICS = ("Engine Layer Information", "Layer(", "Myelin", "Self-Attention", "Detected layernorm",
                    "Total Activation Memory", "Total Host Persistent Memory", "Total Device Persistent Memory",
                    "Engine generation completed")
_SEVERITY_TAGS = {0: "F", 1: "E", 2: "W", 3: "I", 4: "V"}


@dataclass
class ParsedNetwork:
    """A parsed ``INetworkDefinition`` and the builder and parser that must outlive it."""

    trt: Any
    family: str
    builder: Any
    network: Any
    parser: Any
    log: list[tuple[int, str]]  # parser messages, (severity, text)

    @property
    def version(self) -> str:
        return str(self.trt.__version__)


def network_flags(trt: Any, family: str) -> int:
    """``create_network`` flags: STRONGLY_TYPED (by name: its value differs between releases) on
    datacenter TensorRT 10.x; 0 on 11.x and TensorRT-RTX, which are always strongly typed."""
    if family == "tensorrt" and str(trt.__version__).startswith("10."):
        return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return 0


def parse_onnx(onnx_path: str | Path, family: str) -> ParsedNetwork:
    """Parse ``onnx_path`` with ``family``'s ONNX parser into a strongly typed network (no GPU needed
    for TensorRT-RTX). EngineError with every parser error, verbatim, on failure."""
    trt = import_family(family)
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise EngineError(f"ONNX file not found: {onnx_path}")
    logger = family_logger(trt)
    try:
        builder = trt.Builder(logger)
    except Exception as exc:  # noqa: BLE001 - "CUDA initialization failure" surfaces as various types
        raise EngineError(f"cannot start the {LABELS[family]} builder (no CUDA GPU?): {one_line(exc)}") from exc
    network = builder.create_network(network_flags(trt, family))
    parser = trt.OnnxParser(network, logger)
    with logger.capture(4) as log:
        ok = parser.parse_from_file(str(onnx_path))
    if not ok:
        errors = [_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
        errors = errors or [m for s, m in log if s <= 1] or ["no error reported"]
        raise EngineError(f"{LABELS[family]}'s ONNX parser rejected {onnx_path} ({len(errors)} error(s)): "
                          + " | ".join(errors))
    if network.num_outputs == 0:  # the parser accepts some non-ONNX bytes as an empty model
        raise EngineError(f"{LABELS[family]}'s ONNX parser rejected {onnx_path}: it holds no graph outputs "
                          "(not an ONNX model?)")
    return ParsedNetwork(trt, family, builder, network, parser, list(log))


def _targets(trt: Any, family: str, compute_capabilities: Sequence[str] | None) -> tuple[str, ...]:
    if family != "tensorrt-rtx":
        if compute_capabilities:
            raise EngineError("compute capabilities are targets of TensorRT-RTX; datacenter TensorRT builds for "
                              "the GPU it runs on (use --engine tensorrt-rtx, or build on the target GPU)")
        return ()
    wanted = tuple(compute_capabilities) if compute_capabilities else PORTABLE_CAPABILITIES
    supported = [f"{n[2:-1]}.{n[-1]}" for n in trt.ComputeCapability.__members__ if n.startswith("SM")]
    out = []
    for cc in wanted:
        major, minor = parse_capability(cc)
        name = f"{major}.{minor}"
        if not hasattr(trt.ComputeCapability, f"SM{major}{minor}"):
            raise EngineError(f"TensorRT-RTX {trt.__version__} cannot target compute capability {name}; it supports "
                              f"{', '.join(supported)} (9.0 and 10.0 GPUs need datacenter TensorRT)")
        if name not in out:
            out.append(name)
    return tuple(out)


def _configure(parsed: ParsedNetwork, profiles: Sequence[Profile], targets: tuple[str, ...],
               options: BuilderOptions, cache_bytes: bytes | None) -> Any:
    trt, builder, network = parsed.trt, parsed.builder, parsed.network
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * (1 << 30)))
    config.clear_flag(trt.BuilderFlag.TF32)
    config.builder_optimization_level = options.optimization_level
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
            raise EngineError(f"{LABELS[parsed.family]} rejected optimization profile {profile}")
    if targets:
        config.num_compute_capabilities = len(targets)
        for index, cc in enumerate(targets):
            member = getattr(trt.ComputeCapability, "SM" + cc.replace(".", ""))
            if not config.set_compute_capability(member, index):
                raise EngineError(f"TensorRT-RTX refused target compute capability {cc}")
    if options.hardware_compatible:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    if cache_bytes is not None:
        cache = config.create_timing_cache(cache_bytes)
        if not config.set_timing_cache(cache, ignore_mismatch=False):  # made for another GPU or version
            config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    return config


def build_engine(onnx_path: str | Path, plan_path: str | Path, profiles: Iterable[Profile | dict], *,
                 family: str = "auto", compute_capabilities: Sequence[str] | None = None,
                 workspace_gib: float = 4.0, optimization_level: int = 3,
                 timing_cache_path: str | Path | None = None, hardware_compatible: bool = False,
                 log_path: str | Path | None = None) -> EngineRecord:
    """Build ``onnx_path`` into ``plan_path`` (written atomically; an existing plan is kept if the
    build fails) and return its record. See the module docstring for what each family gets.
    EngineError on any failure, with TensorRT's own error text."""
    found = resolve_family(family) if family == "auto" else builder_available(family)
    if not found.ok:
        raise EngineError(f"cannot build a {LABELS[found.family]} engine here: {found.reason}")
    return build_parsed(parse_onnx(onnx_path, found.family), onnx_path, plan_path, profiles,
                        compute_capabilities=compute_capabilities, workspace_gib=workspace_gib,
                        optimization_level=optimization_level, timing_cache_path=timing_cache_path,
                        hardware_compatible=hardware_compatible, log_path=log_path)


def build_parsed(parsed: ParsedNetwork, onnx_path: str | Path, plan_path: str | Path,
                 profiles: Iterable[Profile | dict], *, compute_capabilities: Sequence[str] | None = None,
                 workspace_gib: float = 4.0, optimization_level: int = 3,
                 timing_cache_path: str | Path | None = None, hardware_compatible: bool = False,
                 log_path: str | Path | None = None) -> EngineRecord:
    """:func:`build_engine` on an already parsed network (``onnx_path`` names its source)."""
    family, onnx_path, plan_path = parsed.family, Path(onnx_path), Path(plan_path)
    profiles = [Profile.from_any(p) for p in profiles]
    if not profiles:
        raise EngineError("build_engine needs at least one optimization profile")
    if family == "tensorrt-rtx" and (timing_cache_path is not None or hardware_compatible):
        raise EngineError("TensorRT-RTX has no timing cache and no hardware-compatibility level (those are "
                          "datacenter TensorRT options); it targets compute capabilities instead")
    options = BuilderOptions(float(workspace_gib), optimization_level, hardware_compatible=hardware_compatible,
                             timing_cache=timing_cache_path is not None)
    targets = _targets(parsed.trt, family, compute_capabilities)
    gpu = current_gpu()
    if family == "tensorrt" and gpu is None:
        raise EngineError("datacenter TensorRT built nothing: cannot tell which GPU it builds for (install "
                          "cuda-python, or a CUDA build of torch)")
    cache_path = Path(timing_cache_path) if timing_cache_path is not None else None
    cache = (cache_path.read_bytes() if cache_path.is_file() else b"") if cache_path else None
    config = _configure(parsed, profiles, targets, options, cache)
    with family_logger(parsed.trt).capture(4) as log:
        started = time.perf_counter()
        plan = parsed.builder.build_serialized_network(parsed.network, config)
        seconds = time.perf_counter() - started
    if plan is None:
        errors = [m for s, m in log if s <= 1] or ["no error was logged"]
        raise EngineError(f"{LABELS[family]} could not build an engine from {onnx_path} (workspace limit "
                          f"{options.workspace_gib:g} GiB: the engine's activation memory for the largest profile "
                          "shape must fit in it): " + " | ".join(errors))
    data = memoryview(plan)
    _atomic_write(plan_path, data)
    if cache_path is not None:
        _atomic_write(cache_path, memoryview(config.get_timing_cache().serialize()))
    record = EngineRecord(
        family=family, version=parsed.version, plan=plan_path.name, onnx=onnx_path.name,
        plan_sha256=hashlib.sha256(data).hexdigest(), plan_bytes=data.nbytes, profiles=tuple(profiles),
        targets=targets, built_on=gpu, options=options, build_seconds=round(seconds, 3),
        build_log=Path(log_path).name if log_path is not None else None)
    if log_path is not None:
        _atomic_write(Path(log_path), build_log_text(record, parsed.log + list(log)).encode())
    return replace(record, not_run_reason=_not_run_reason(record, gpu))


def _not_run_reason(record: EngineRecord, gpu: Gpu | None) -> str:
    if gpu is None:
        return "built on a machine without a CUDA GPU"
    ok, problems = can_run(record, gpu)
    return "not run yet (this GPU can run it)" if ok else f"cannot run on this machine's {gpu}: " + "; ".join(problems)


def build_log_text(record: EngineRecord, log: list[tuple[int, str]]) -> str:
    """The builder log kept beside the plan: a header, every warning and error, and the lines about
    what the engine became (:data:`BUILD_LOG_TOPICS`)."""
    head = [f"# {record.label} build of {record.onnx} -> {record.plan} in {record.build_seconds:.1f} s",
            f"# runs on: {record.runs_on()}",
            "# profiles: " + "; ".join(str(p) for p in record.profiles),
            "# kept: every warning and error, and lines about " + ", ".join(BUILD_LOG_TOPICS), ""]
    kept = [f"[{_SEVERITY_TAGS.get(s, s)}] {m}" for s, m in log
            if s <= 2 or any(topic in m for topic in BUILD_LOG_TOPICS)]
    return "\n".join(head + kept) + "\n"


def tensorrt_verdict(onnx_path: str | Path, profiles: Iterable[Profile | dict], *,
                     family: str = "auto", compute_capabilities: Sequence[str] | None = None) -> dict:
    """Does TensorRT accept this graph? Parse and build it (the plan is discarded) and return
    ``{"family", "version", "parsed", "built", "errors"}`` with TensorRT's error text verbatim.
    For the naive FP16 graph, reported beside ONNX Runtime's verdict; never raises for a graph
    TensorRT refuses (EngineError only when no builder is available at all)."""
    found = resolve_family(family) if family == "auto" else builder_available(family)
    if not found.ok:
        raise EngineError(f"cannot ask {LABELS[found.family]} for a verdict here: {found.reason}")
    verdict: dict = {"family": found.family, "version": found.version, "parsed": False, "built": False,
                     "errors": []}
    try:
        parsed = parse_onnx(onnx_path, found.family)
    except EngineError as exc:
        verdict["errors"] = [str(exc)]
        return verdict
    verdict["parsed"] = True
    with tempfile.TemporaryDirectory(prefix="mbert-verdict-") as tmp:
        try:
            record = build_parsed(parsed, onnx_path, Path(tmp) / "verdict.plan", profiles,
                                  compute_capabilities=compute_capabilities)
        except EngineError as exc:
            verdict["errors"] = [str(exc)]
            return verdict
    verdict.update(built=True, plan_bytes=record.plan_bytes, build_seconds=record.build_seconds)
    return verdict


# --- helpers -------------------------------------------------------------------------------------

def _parser_error(error: Any) -> str:
    """One parser error verbatim, prefixed by ONNX node name and operator."""
    where = [str(v) for v in (error.node_name(), error.node_operator()) if v]
    if not where and error.node() >= 0:
        where.append(f"node #{error.node()}")
    return " ".join(([f"[{' '.join(where)}]"] if where else []) + [f"{error.code()}:", one_line(error.desc())])


def _atomic_write(path: Path, data: Any) -> None:
    """Write bytes (or any buffer) via a temp file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
