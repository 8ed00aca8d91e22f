"""Build a TensorRT or TensorRT-RTX engine from an ONNX graph: one builder API for both families.

``build_engine(onnx, plan, profiles, family="auto" | "tensorrt" | "tensorrt-rtx", ...)`` writes the
plan and returns a :class:`BuiltPlan` (what was built, for which GPUs, with which options, and the
builder's log); the export's engine stage turns it into the manifest's
:class:`~mbert.bundle.engine.EngineRecord`. What each family gets:

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
without a GPU): the engine stage then records it as "built, not yet run" and why. The builder's
log is captured at VERBOSE; :func:`build_log_text` keeps its informative lines (warnings, engine
layer information, Myelin and attention fusion) for the bundle's ``tensorrt_build.log``.

The workspace limit. ``workspace_gib=None`` (the default) leaves TensorRT's own limit in place: the
memory of the GPU the builder runs on (datacenter TensorRT), 64 GiB for a TensorRT-RTX build on a
machine without one (read back from the config with 1.7.1). The limit caps the scratch and
activation memory the builder may plan for; it allocates nothing. ModernBERT's activation memory
grows with the largest profile shape (batch x sequence): the full-size FP16 build at 32 x 8192
asks for 4.59 GB and FP32 for ~13 GB (``benchmarks/tensorrt_build.py``), so a fixed cap such as
4 GiB fails the default profile with OutOfMemory, and any fixed number
fails some profile. The real bound is the memory of the GPU the plan runs on; ``--workspace-gib``
lowers the cap where a smaller GPU must be served. The record keeps the limit the config had.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from mbert.bundle.engine import LABELS, BuilderOptions, Gpu, Profile, TensorRTVerdict, parse_capability
from mbert.bundle.errors import EngineError
from mbert.bundle.files import atomic_write
from mbert.runtime.backends.cuda import current_gpu
from mbert.runtime.backends.family import (
    PORTABLE_CAPABILITIES,
    builder_available,
    family_logger,
    import_family,
    one_line,
    resolve_family,
)

__all__ = ["ParsedNetwork", "BuiltPlan", "profiles_from", "network_flags", "parse_onnx", "build_engine",
           "build_parsed", "build_log_text", "tensorrt_verdict", "BUILD_LOG_TOPICS"]

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
    source: Path  # the ONNX file parsed
    builder: Any
    network: Any
    parser: Any
    log: list[tuple[int, str]]  # parser messages, (severity, text)

    @property
    def version(self) -> str:
        return str(self.trt.__version__)


@dataclass(frozen=True)
class BuiltPlan:
    """A plan :func:`build_engine` wrote, and how it was built."""

    family: str
    version: str
    plan: Path
    onnx: Path
    profiles: tuple[Profile, ...]
    targets: tuple[str, ...]  # TensorRT-RTX: the compute capabilities it was built for
    built_on: Gpu | None  # the build machine's GPU (None: TensorRT-RTX without one)
    options: BuilderOptions
    seconds: float
    log: tuple[tuple[int, str], ...]  # every parser and builder message, (severity, text)

    @property
    def label(self) -> str:
        return f"{LABELS[self.family]} {self.version}"

    def runs_on(self) -> str:
        if self.targets:
            return f"GPUs of compute capability {', '.join(self.targets)}"
        assert self.built_on is not None
        if self.options.hardware_compatible:
            return "any Ampere or newer GPU (compute capability >= 8.0)"
        return f"GPUs of compute capability {self.built_on.compute_capability} ({self.built_on.name})"


# Typical retrieval / classification inputs are at most this long (see profiles_from).
_SHORT_TEXT = 512


def profiles_from(max_batch: int, max_seq_len: int, opt_batch: int | None = None,
                  opt_seq_len: int | None = None,
                  split_seq: Sequence[int] | None = None) -> list[Profile]:
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
        raise EngineError(f"split_seq must be strictly increasing positive ints, got {list(split_seq)}")
    if bounds and bounds[-1] > max_seq_len:
        raise EngineError(f"split_seq {list(split_seq)} goes beyond max_seq_len {max_seq_len}")
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
    from mbert.export.transaction import deferred_interrupts

    with deferred_interrupts(), logger.capture(4) as log:
        ok = parser.parse_from_file(str(onnx_path))
    if not ok:
        errors = [_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
        errors = errors or [m for s, m in log if s <= 1] or ["no error reported"]
        raise EngineError(f"{LABELS[family]}'s ONNX parser rejected {onnx_path} ({len(errors)} error(s)): "
                          + " | ".join(errors))
    if network.num_outputs == 0:  # the parser accepts some non-ONNX bytes as an empty model
        raise EngineError(f"{LABELS[family]}'s ONNX parser rejected {onnx_path}: it holds no graph outputs "
                          "(not an ONNX model?)")
    return ParsedNetwork(trt, family, onnx_path, builder, network, parser, list(log))


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
        try:
            major, minor = parse_capability(cc)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        name = f"{major}.{minor}"
        if not hasattr(trt.ComputeCapability, f"SM{major}{minor}"):
            raise EngineError(f"TensorRT-RTX {trt.__version__} cannot target compute capability {name}; it supports "
                              f"{', '.join(supported)} (9.0 and 10.0 GPUs need datacenter TensorRT)")
        if name not in out:
            out.append(name)
    return tuple(out)


def _configure(parsed: ParsedNetwork, profiles: Sequence[Profile], targets: tuple[str, ...], *,
               workspace_gib: float | None, optimization_level: int, hardware_compatible: bool,
               cache_bytes: bytes | None) -> Any:
    trt, builder, network = parsed.trt, parsed.builder, parsed.network
    config = builder.create_builder_config()
    if workspace_gib is not None:  # None: TensorRT's own limit (see the module docstring)
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    config.clear_flag(trt.BuilderFlag.TF32)
    config.builder_optimization_level = optimization_level
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
    if hardware_compatible:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    if cache_bytes is not None:
        cache = config.create_timing_cache(cache_bytes)
        if not config.set_timing_cache(cache, ignore_mismatch=False):  # made for another GPU or version
            config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    return config


def build_engine(onnx_path: str | Path, plan_path: str | Path, profiles: Iterable[Profile], *,
                 family: str = "auto", compute_capabilities: Sequence[str] | None = None,
                 workspace_gib: float | None = None, optimization_level: int = 3,
                 timing_cache_path: str | Path | None = None, hardware_compatible: bool = False) -> BuiltPlan:
    """Build ``onnx_path`` into ``plan_path`` (written atomically; an existing plan is kept if the
    build fails). See the module docstring for what each family gets. EngineError on any failure,
    with TensorRT's own error text."""
    found = resolve_family(family) if family == "auto" else builder_available(family)
    if not found.ok:
        raise EngineError(f"cannot build a {LABELS[found.family]} engine here: {found.reason}")
    return build_parsed(parse_onnx(onnx_path, found.family), onnx_path, plan_path, profiles,
                        compute_capabilities=compute_capabilities, workspace_gib=workspace_gib,
                        optimization_level=optimization_level, timing_cache_path=timing_cache_path,
                        hardware_compatible=hardware_compatible)


def build_parsed(parsed: ParsedNetwork, onnx_path: str | Path, plan_path: str | Path, profiles: Iterable[Profile],
                 *, compute_capabilities: Sequence[str] | None = None, workspace_gib: float | None = None,
                 optimization_level: int = 3, timing_cache_path: str | Path | None = None,
                 hardware_compatible: bool = False, progress: Callable[[str], None] | None = None) -> BuiltPlan:
    """:func:`build_engine` on an already parsed network (``onnx_path`` names its source); ``progress``
    receives a line about the builder's phases (at most every few seconds)."""
    family, onnx_path, plan_path = parsed.family, Path(onnx_path), Path(plan_path)
    profiles = tuple(profiles)
    if not profiles:
        raise EngineError("build_engine needs at least one optimization profile")
    if family == "tensorrt-rtx" and (timing_cache_path is not None or hardware_compatible):
        raise EngineError("TensorRT-RTX has no timing cache and no hardware-compatibility level (those are "
                          "datacenter TensorRT options); it targets compute capabilities instead")
    if optimization_level not in range(6):
        raise EngineError(f"builder optimization level must be 0..5, got {optimization_level!r}")
    targets = _targets(parsed.trt, family, compute_capabilities)
    gpu = current_gpu()
    if family == "tensorrt" and gpu is None:
        raise EngineError("datacenter TensorRT built nothing: cannot tell which GPU it builds for (install "
                          "cuda-python, or a CUDA build of torch)")
    cache_path = Path(timing_cache_path) if timing_cache_path is not None else None
    cache = (cache_path.read_bytes() if cache_path.is_file() else b"") if cache_path else None
    config = _configure(parsed, profiles, targets, workspace_gib=workspace_gib, optimization_level=optimization_level,
                        hardware_compatible=hardware_compatible, cache_bytes=cache)
    limit = config.get_memory_pool_limit(parsed.trt.MemoryPoolType.WORKSPACE) / (1 << 30)
    plan, log, seconds = _build(parsed, config, progress)
    if plan is None:
        errors = [m for s, m in log if s <= 1] or ["no error was logged"]
        raise EngineError(f"{LABELS[family]} could not build an engine from {onnx_path} (workspace limit "
                          f"{limit:g} GiB; an OutOfMemory error means the activation memory of the largest profile "
                          "shape does not fit in it: raise --workspace-gib or lower --max-batch): " + " | ".join(errors))
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(plan_path, memoryview(plan))
    if cache_path is not None:
        atomic_write(cache_path, memoryview(config.get_timing_cache().serialize()))
    options = BuilderOptions(workspace_gib=limit, optimization_level=optimization_level, tf32=False,
                             strongly_typed=True, hardware_compatible=hardware_compatible,
                             timing_cache=cache_path is not None)
    return BuiltPlan(family, parsed.version, plan_path, onnx_path, profiles, targets, gpu, options,
                     round(seconds, 3), tuple(parsed.log) + tuple(log))


def _build(parsed: ParsedNetwork, config: Any, say: Callable[[str], None] | None = None
           ) -> tuple[Any, list[tuple[int, str]], float]:
    """``build_serialized_network``: (the plan or None, every message it logged, seconds). Its phases
    are reported through ``say`` (TensorRT's progress monitor, at most a line every
    :data:`PROGRESS_EVERY_S`), and Ctrl-C or SIGTERM cancel it (the monitor tells TensorRT to stop;
    the interrupt is raised when the builder has returned)."""
    from mbert.export.transaction import deferred_interrupts

    with deferred_interrupts() as interrupted, family_logger(parsed.trt).capture(4) as log, \
            native_stdout() as printed:
        monitor = _monitor(parsed.trt, say, interrupted)
        config.progress_monitor = monitor
        started = time.perf_counter()
        plan = parsed.builder.build_serialized_network(parsed.network, config)
        seconds = time.perf_counter() - started
        config.progress_monitor = None
        if interrupted() and say is not None:  # the interrupt is raised when the block ends
            say(f"TensorRT build cancelled by the interrupt after {seconds:.1f}s"
                + ("" if plan is None else " (it had finished; its plan is discarded)"))
    return plan, list(log) + [(2, line) for line in printed], seconds


@contextlib.contextmanager
def native_stdout() -> Iterator[list[str]]:
    """What native code prints to standard output (file descriptor 1) while the block runs, as lines,
    instead of on the terminal: TensorRT-RTX's graph compiler prints warnings there on its own
    (``WARNING: in op ... requires precision-lose casting``), past its logger; they belong in the build
    log, not in the command's output. Python's own output is flushed first."""
    import sys
    import tempfile

    lines: list[str] = []
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no standard output at all
        yield lines
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            lines += [line for line in sink.read().decode(errors="replace").splitlines() if line.strip()]


PROGRESS_EVERY_S = 5.0


def _monitor(trt: Any, say: Callable[[str], None] | None, interrupted: Callable[[], bool]) -> Any:
    """A ``trt.IProgressMonitor`` that reports the build's top-level phases and steps through ``say`` and
    cancels the build once ``interrupted()`` (TensorRT ignores what its callbacks raise, so neither
    method may raise)."""

    class Monitor(trt.IProgressMonitor):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.steps: dict[str, tuple[str | None, int]] = {}
            self.last = time.perf_counter()

        def _say(self, text: str, force: bool = False) -> None:
            now = time.perf_counter()
            if say is not None and (force or now - self.last >= PROGRESS_EVERY_S):
                self.last = now
                with contextlib.suppress(Exception):
                    say(text)

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.steps[phase_name] = (parent_phase, num_steps)
            if parent_phase is None:
                self._say(f"TensorRT build: {phase_name} ({num_steps} steps)", force=True)

        def step_complete(self, phase_name: str, step: int) -> bool:
            parent, total = self.steps.get(phase_name, (None, 0))
            self._say(f"TensorRT build: {phase_name}: step {step + 1}/{total}")
            return not interrupted()

        def phase_finish(self, phase_name: str) -> None:
            self.steps.pop(phase_name, None)

    return Monitor()


def build_log_text(built: BuiltPlan) -> str:
    """The builder log kept beside the plan: a header, every warning and error, and the lines about
    what the engine became (:data:`BUILD_LOG_TOPICS`)."""
    head = [f"# {built.label} build of {built.onnx.name} -> {built.plan.name} in {built.seconds:.1f} s",
            f"# runs on: {built.runs_on()}",
            "# profiles: " + "; ".join(str(p) for p in built.profiles),
            "# kept: every warning and error, and lines about " + ", ".join(BUILD_LOG_TOPICS), ""]
    kept = [f"[{_SEVERITY_TAGS.get(s, s)}] {m}" for s, m in built.log
            if s <= 2 or any(topic in m for topic in BUILD_LOG_TOPICS)]
    return "\n".join(head + kept) + "\n"


def tensorrt_verdict(onnx_path: str | Path, profiles: Iterable[Profile], *, family: str,
                     compute_capabilities: Sequence[str] | None = None) -> TensorRTVerdict:
    """Does ``family``'s TensorRT accept this graph? Parse and build it (the plan is discarded) and
    return the verdict with TensorRT's error text verbatim. For the naive FP16 graph, reported
    beside ONNX Runtime's verdict; never raises for a graph TensorRT refuses (EngineError only when
    the family's builder is not available at all)."""
    found = builder_available(family)
    if not found.ok:
        raise EngineError(f"cannot ask {LABELS[found.family]} for a verdict here: {found.reason}")
    try:
        parsed = parse_onnx(onnx_path, found.family)
    except EngineError as exc:
        return TensorRTVerdict(found.family, found.version, False, False, one_line(exc))
    try:
        config = _configure(parsed, tuple(profiles), _targets(parsed.trt, found.family, compute_capabilities),
                            workspace_gib=None, optimization_level=3, hardware_compatible=False, cache_bytes=None)
    except EngineError as exc:
        return TensorRTVerdict(found.family, found.version, True, False, one_line(exc))
    plan, log, _ = _build(parsed, config)
    if plan is None:
        errors = [m for s, m in log if s <= 1] or ["no error was logged"]
        return TensorRTVerdict(found.family, found.version, True, False, one_line(" | ".join(errors)))
    return TensorRTVerdict(found.family, found.version, True, True, None)


# --- helpers -------------------------------------------------------------------------------------

def _parser_error(error: Any) -> str:
    """One parser error verbatim, prefixed by ONNX node name and operator."""
    where = [str(v) for v in (error.node_name(), error.node_operator()) if v]
    if not where and error.node() >= 0:
        where.append(f"node #{error.node()}")
    return " ".join(([f"[{' '.join(where)}]"] if where else []) + [f"{error.code()}:", one_line(error.desc())])
