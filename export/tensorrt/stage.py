"""The TensorRT engine stage: ``model.plan`` from ``model.fp16.onnx``, checked inside TensorRT.

Steps (:func:`build_in`, shared by the export and ``mbert-export --engine-only``):

1. the family: ``--engine auto`` takes the first whose builder starts here (datacenter TensorRT, then
   TensorRT-RTX) and says which; with no builder the export continues without an engine and says how
   to build it later (an explicitly requested family that is missing is an error);
2. parse ``model.fp16.onnx`` and build it: every optimization profile, TensorRT-RTX's target compute
   capabilities, datacenter TensorRT's timing cache and hardware compatibility; the builder's log
   (warnings, engine layer information, attention fusion) is kept as ``tensorrt_build.log``;
3. the precision walk over the network TensorRT built from (:mod:`mbert.export.tensorrt.precision`): every
   site of the FP16 plan (``precision.json``) must compute in TensorRT in the precision the plan
   gives it; saved as ``tensorrt_precision.json``; a failed walk fails the export;
4. TensorRT's verdict on the naive all-FP16 graph, reported beside ONNX Runtime's (never gating);
5. where the plan can run here, the parity grid against the FP32 graph on ONNX Runtime (FP16
   tolerances; a failure fails the export); elsewhere it is recorded "built, not yet run" with the
   reason, and the runtime runs the grid on its first open on a supported GPU.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from mbert.bundle.engine import EngineRecord, EngineValidation, TensorRTVerdict
from mbert.bundle.errors import EngineError
from mbert.bundle.names import BUILD_LOG, FP16_GRAPH, FP16_PLAN, FP32_GRAPH, PLAN, PRECISION_WALK
from mbert.bundle.validation import Case, ValidationReport
from mbert.export.options import ExportOptions
from mbert.runtime.backends.cuda import current_gpu
from mbert.runtime.backends.family import Availability, resolve_family

TIMING_CACHE = ".trt-timing.cache"  # beside the bundles: reused across builds (datacenter TensorRT only)


@dataclass(frozen=True)
class EngineOutcome:
    record: EngineRecord | None
    naive: TensorRTVerdict | None  # TensorRT's verdict on the naive all-FP16 graph
    note: str  # one line for the user: what was built and with which family, or why nothing was


def engine_stage(staging: Path, target: Path, max_len: int, options: ExportOptions,
                 cases: Sequence[Case], say: Callable[[str], None] = lambda message: None,
                 named: Path | None = None) -> EngineOutcome:
    """Build and check the plan in ``staging`` (the bundle will be ``target``, which the user calls
    ``named``); ``say`` reports each step."""
    later = f"build it later from this bundle with: mbert-export --engine-only {named or target}"
    if options.engine == "none":
        return EngineOutcome(None, None, f"no TensorRT engine (--engine none); {later}")
    try:
        found = resolve_family(options.family)
    except EngineError as exc:
        if options.family != "auto":
            raise
        return EngineOutcome(None, None, f"no TensorRT engine: {exc}; {later}")
    return build_in(staging, found, options, max_len, cases, target.parent / TIMING_CACHE, say)


def chosen(found: Availability, options: ExportOptions) -> str:
    """The family that builds, and what chose it."""
    if options.engine != "auto":
        why = f"--engine {options.engine}"
    elif options.family == "auto":
        why = "chosen by --engine auto: the builder that starts here"
    elif options.compute_capabilities:
        why = "--compute-capability targets TensorRT-RTX"
    else:
        why = "--hardware-compatible is datacenter TensorRT's"
    return f"{found} ({why})"


def build_in(folder: Path, found: Availability, options: ExportOptions, max_len: int, cases: Sequence[Case],
             timing_cache: Path, say: Callable[[str], None] = lambda message: None) -> EngineOutcome:
    """Steps 2-5 of the module docstring in ``folder`` (it holds the bundle's graphs and
    precision.json); returns the engine record, TensorRT's naive verdict and the note. ``say``
    reports progress."""
    from mbert.export.fp16.precision import load_precision
    from mbert.export.tensorrt.build import build_log_text, build_parsed, parse_onnx, profiles_from
    from mbert.export.tensorrt.precision import save_walk, walk_parsed

    profiles = profiles_from(options.max_batch, max_len, options.opt_batch, options.opt_seq_len, options.split_seq)
    _, plan = load_precision(folder / FP16_PLAN)
    parsed = parse_onnx(folder / FP16_GRAPH, found.family)
    say(f"parsed {FP16_GRAPH}; building {PLAN} with {found} ({len(profiles)} optimization profiles)")
    datacenter = found.family == "tensorrt"
    built = build_parsed(parsed, folder / FP16_GRAPH, folder / PLAN, profiles,
                         compute_capabilities=options.compute_capabilities, workspace_gib=options.workspace_gib,
                         timing_cache_path=timing_cache if datacenter else None,
                         hardware_compatible=options.hardware_compatible, progress=say)
    (folder / BUILD_LOG).write_text(build_log_text(built), encoding="utf-8")
    say(f"built {PLAN} with {built.label} in {built.seconds:.1f}s; checking its network against the FP16 plan")
    walk, listing = walk_parsed(parsed, plan, file=PRECISION_WALK)  # the very network the builder was given
    save_walk(folder / PRECISION_WALK, walk, listing)
    walk.raise_if_failed()
    say("precision walk passed; building the naive all-FP16 graph for TensorRT's verdict on it")
    naive = naive_verdict(folder / FP16_GRAPH, profiles, found.family, options.compute_capabilities)
    draft = EngineRecord(file=PLAN, onnx=FP16_GRAPH, family=found.family, version=found.version,
                         profiles=built.profiles, targets=built.targets, built_on=built.built_on, options=built.options,
                         build_seconds=built.seconds, build_log=BUILD_LOG, precision_walk=walk,
                         validation=None, not_run_reason="not run yet")  # run_here completes it
    record = run_here(folder, draft, cases)
    note = (f"TensorRT engine {PLAN}: {chosen(found, options)}, built in {built.seconds:.1f}s for "
            f"{built.runs_on()}; precision walk passed (FP32 sites: {', '.join(walk.fp32_sites) or 'none'}); "
            f"{record.status}" + (f" ({record.not_run_reason})" if record.validation is None else
                                  f" on {record.validation.gpu}"))
    return EngineOutcome(record, naive, note)


def run_here(folder: Path, draft: EngineRecord, cases: Sequence[Case]) -> EngineRecord:
    """``draft`` validated on this machine's GPU where the plan can run here, else "built, not yet run"
    with the reason."""
    from mbert.runtime.backends.checks import can_run

    gpu = current_gpu()
    ok, problems = can_run(draft, gpu, folder / PLAN)
    if not ok:
        why = ("built on a machine without a CUDA GPU; the runtime runs the parity grid when it first opens the plan "
               "on a GPU it supports" if gpu is None else f"this machine's {gpu} cannot run it: {'; '.join(problems)}")
        return replace(draft, not_run_reason=why)
    assert gpu is not None
    report = validate_engine(folder, cases, draft.family)
    return replace(draft, validation=EngineValidation(gpu, draft.version, report), not_run_reason=None)


def validate_engine(folder: Path, cases: Sequence[Case], family: str) -> ValidationReport:
    """The plan against the bundle's FP32 ONNX graph on ONNX Runtime (the eager model's proven twin),
    judged by the FP16 tolerances; ValidationError when it misses."""
    from mbert.runtime.backends.tensorrt import TensorRTRunner
    from mbert.runtime.backends.verdicts import engine_parity

    runner = TensorRTRunner(folder / PLAN, family=family)
    report = engine_parity(runner.run_batch, folder / FP32_GRAPH, cases, PLAN, runner.loaded.output_names)
    report.raise_if_failed()
    return report


def naive_verdict(graph: Path, profiles, family: str, targets: Sequence[str] | None) -> TensorRTVerdict | None:
    """TensorRT's verdict on the naive all-FP16 conversion of ``graph`` (``fp16.write_naive_fp16``;
    None when the naive graph cannot even be written; ONNX Runtime's verdict says why)."""
    from mbert.export.fp16.naive import write_naive_fp16
    from mbert.export.tensorrt.build import tensorrt_verdict

    with tempfile.TemporaryDirectory(prefix="mbert-naive-") as tmp:
        path = Path(tmp) / "naive.fp16.onnx"
        try:
            write_naive_fp16(graph, path)
        except Exception:  # noqa: BLE001 - the naive conversion failing is ONNX Runtime's finding, reported there
            return None
        return tensorrt_verdict(path, profiles, family=family, compute_capabilities=targets)
