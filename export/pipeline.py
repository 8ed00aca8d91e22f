"""The export pipeline: load, trace, [scan, mixed precision], validate, [validate FP16, engine],
[INT8 sensitivity, plan, blind], write.

:func:`export_bundle` reads as its stages in order. Each stage is a function of one
:class:`Context`, built by the load stage from options that were checked before any work started;
the bundle is written as a transaction (:mod:`mbert.export.transaction`).

The two traces (single-threaded) run in a child process (:mod:`mbert.export.background`) while the
parent does eager work on the other cores: the FP32 trace beside the scan (or, without ``--fp16``,
beside the reference outputs), the mixed-precision trace beside the FP32 graph's validation. So the
``trace`` and ``mixed precision`` stages start a job, and the stage that needs its file waits for
it; a "background" report gives each job's own time.
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mbert.bundle import IO, GraphRecord, Manifest, Source, model_info, write
from mbert.bundle.errors import BundleError, ExportError, OptionError
from mbert.bundle.names import CONFIG, FP16_GRAPH, FP32_GRAPH, INT8_GRAPH, MANIFEST, PLAN, TOKENIZER
from mbert.bundle.texts import calibration_texts, load_text_file
from mbert.bundle.tokenizer import check_token_ids, load_tokenizer
from mbert.bundle.validation import compare, grid_cases, tolerances_for
from mbert.export.background import Jobs
from mbert.export.context import Context, Reporter
from mbert.export.device import resolve_device
from mbert.export.fp16 import stage as fp16_mod
from mbert.export.int8 import stage as int8_stage
from mbert.export.onnx.lowering import TARGET_INFO
from mbert.export.onnx.trace import graph_opset, to_onnx
from mbert.export.options import ExportOptions
from mbert.export.progress import Progress, ProgressFn, case_progress
from mbert.export.reference import ReferenceOutputs
from mbert.export.tensorrt.stage import EngineOutcome, engine_stage
from mbert.export.transaction import check_source, check_target, resolved, transaction
from mbert.modeling import load_model, load_pooling, resolve
from mbert.modeling.random import is_random
from mbert.runtime.backends.onnxruntime import onnx_runner


@dataclass
class ExportResult:
    bundle: Path
    manifest: Manifest
    timings: dict[str, float]
    fp16: fp16_mod.Fp16Outcome | None = None
    engine_note: str = ""
    int8: int8_stage.Int8Outcome | None = None


class _Stages:
    def __init__(self, report: Reporter, total: int):
        self.report, self.total, self.n, self.timings = report, total, 0, {}

    def run(self, name: str, fn, *args, background: bool = False):
        """``fn(*args)`` as the next stage; ``background``: it starts a job, reported as "started"."""
        self.n += 1
        self.report("stage", f"[{self.n}/{self.total}] {name}")
        t0 = time.perf_counter()
        result = fn(*args)
        self.timings[name] = time.perf_counter() - t0
        self.report("started" if background else "done", f"{name}: {self.timings[name]:.1f}s")
        return result


def export_bundle(source: str | Path, options: ExportOptions, report: Reporter = lambda e, m: None) -> ExportResult:
    """Export ``source`` (hub id or folder) to a validated bundle at ``options.target(source)``."""
    options.check()
    _check_builder(options)
    device = _device(options)
    named = options.target(source)  # as the user named it: the lines printed name the bundle so
    target = resolved(named)  # absolute: ``--out .`` names the folder itself
    check_target(target, options.overwrite)
    check_nothing_dropped(target, options)
    check_source(resolve(str(source)).path, target)
    texts = calibration_texts() + (load_text_file(options.calibration) if options.calibration else [])
    stages = _Stages(report, 4 + (4 if options.fp16 else 0) + (3 if options.int8 else 0))
    with transaction(target, options.overwrite, lambda m: report("info", m)) as staging, Jobs(report) as jobs:
        ctx = stages.run("load", load, str(source), options, target, staging, texts, device, jobs,
                         _progress(report, jobs))
        if is_random(ctx.model.source.path):
            report("warn", f"{source} has RANDOM weights (written by --random-checkpoint): fine for trying the tool, "
                           "meaningless as a model")
        stages.run("trace", trace, ctx, background=True)  # collected by validate
        fp16 = engine = plan = scan_report = mixed = None
        if options.fp16:
            scan_report, plan = stages.run("scan", fp16_mod.scan_and_plan, ctx)
            # in the background beside validate; collected by validate fp16
            mixed = stages.run("mixed precision", fp16_mod.trace_mixed, ctx, plan, background=True)
        io, fp32_graph, reference = stages.run("validate", validate, ctx)
        graphs = [fp32_graph]
        if options.fp16:
            fp16 = stages.run("validate fp16", fp16_mod.validate_mixed, ctx, reference, scan_report, plan, mixed)
            graphs.append(fp16.graph)
            engine = stages.run("engine", engine_stage, staging, target, ctx.max_len, options, ctx.cases,
                                lambda message: report("progress", f"engine: {message}"), named)
        int8 = None
        if options.int8:  # independent of --fp16: the CPU path
            sensitivity = stages.run("int8 sensitivity", int8_stage.sensitivity, ctx)
            chosen = stages.run("int8 plan", int8_stage.choose, ctx, reference, sensitivity)
            int8 = stages.run("int8 blind", int8_stage.finish, ctx, reference, chosen)
            graphs.append(int8.graph)
        manifest = stages.run("write", write_bundle, ctx, options, io, graphs, fp16, engine, int8)
    return ExportResult(named, manifest, stages.timings, fp16, engine.note if engine else "", int8)


def check_nothing_dropped(target: Path, options: ExportOptions) -> None:
    """An export rebuilds the whole bundle, so ``--overwrite`` refuses to drop what the bundle at
    ``target`` has and this export would not rebuild: its FP16 graph without --fp16, its engine without
    --fp16 or with no builder here, its INT8 graph without --int8 (BundleError saying what to add)."""
    from mbert.bundle.manifest import read_raw

    if not options.overwrite or not (target / MANIFEST).is_file():
        return
    try:
        raw = read_raw(target)
    except BundleError:  # another format: check_target let it be replaced whole
        return
    has = {g.get("precision") for g in raw.get("graphs") or () if isinstance(g, dict)}
    dropped = []
    if "fp16" in has and not options.fp16:
        dropped.append(f"{FP16_GRAPH} (add --fp16)")
    if raw.get("engine") and (not options.fp16 or options.family == "none" or not _builds_engine(options)):
        dropped.append(f"{PLAN} (add --fp16 where a TensorRT builder is installed, or keep it with "
                       "mbert-export --engine-only after exporting)")
    if "int8" in has and not options.int8:
        dropped.append(f"{INT8_GRAPH} (add --int8)")
    if dropped:
        raise BundleError(f"{target}: --overwrite rebuilds the whole bundle and would drop {'; '.join(dropped)}; "
                          "name them again, or remove the bundle first")


def _builds_engine(options: ExportOptions) -> bool:
    from mbert.runtime.backends.family import resolve_family

    try:
        resolve_family(options.family)
    except Exception:  # noqa: BLE001 - no builder here: the engine would be dropped
        return False
    return True


def _check_builder(options: ExportOptions) -> None:
    """An engine family named explicitly must be able to build here: fail before any work, not
    after the trace and the scan (``auto`` falls back to no engine with a note instead)."""
    if not options.fp16 or options.family not in ("tensorrt", "tensorrt-rtx"):
        return
    from mbert.runtime.backends.family import builder_available

    found = builder_available(options.family)
    if not found.ok:
        raise OptionError(f"--engine {options.family}: {found.reason}")


def _device(options: ExportOptions) -> torch.device:
    try:
        return resolve_device(options.device)
    except ExportError as exc:
        raise OptionError(str(exc)) from exc


def _throttled(report: Reporter, every_s: float = 5.0) -> ProgressFn:
    """Progress records as "progress" events: a line once a stage has run ``every_s`` and then at
    most every ``every_s`` (the scan's lines carry its estimate of the time left)."""
    last: dict[str, float] = {}

    def show(p: Progress) -> None:
        if p.elapsed_s < last.get(p.stage, 0.0):  # the same stage name again (the second trace)
            last[p.stage] = 0.0
        if p.elapsed_s >= every_s and p.elapsed_s - last.get(p.stage, 0.0) >= every_s:
            last[p.stage] = p.elapsed_s
            report("progress", p.line())

    return show


def _progress(report: Reporter, jobs: Jobs) -> ProgressFn:
    """The stages' progress callback. Called between the parent's units of work, it also forwards
    the background jobs' records and gives the parent its threads back once a job is done."""
    show = jobs.progress = _throttled(report)  # the jobs' own records go straight to the throttle

    def progress(p: Progress) -> None:
        jobs.poll()
        show(p)

    return progress


def load(source: str, options: ExportOptions, target: Path, staging: Path, texts: list[str], device: torch.device,
         jobs: Jobs, progress: ProgressFn | None) -> Context:
    """Config, options against it, tokenizer and ids, pooling, then the weights (strict, finite), and
    the validation grid."""
    from mbert.bundle.config import ModernBertConfig

    folder = resolve(source).path
    cfg = ModernBertConfig.from_file(folder / CONFIG)
    if options.task is not None:
        cfg = cfg.with_task(options.task)
    pooling = load_pooling(folder) if cfg.task == "encoder" else None
    max_len = options.max_len_for(cfg, pooling.max_seq_length if pooling else None)
    tokenizer = load_tokenizer(folder)
    check_token_ids(cfg, tokenizer, folder / TOKENIZER)
    model = load_model(source, task=options.task)
    cases = grid_cases(tokenizer, cfg, max_len, texts)
    return Context(source, target, staging, model, pooling, tokenizer, max_len, options.opset, options.margin,
                   tuple(texts), tuple(cases), device, jobs, progress)


def trace(ctx: Context) -> None:
    """Start tracing ``model.onnx`` in the background: the FP32 graph in ONNX Runtime's form (fused
    attention, ``mbert.export.onnx.lowering``). :func:`validate` collects it."""
    ctx.jobs.start("trace", to_onnx, ctx.model, ctx.staging / FP32_GRAPH, pooling=ctx.pooling,
                   opset=ctx.opset, max_seq_len=ctx.max_len, target="onnxruntime")


def validate(ctx: Context) -> tuple[IO, GraphRecord, ReferenceOutputs]:
    """The eager reference outputs (on --device, while a trace may still run), then ``model.onnx``
    (waiting for its trace) against them; the reference outputs are returned for the later stages."""
    reference = ReferenceOutputs(ctx.graph, device=ctx.device).precompute(ctx.cases, ctx.progress)
    specs = ctx.jobs.collect("trace")
    io = IO(tuple(s for s in specs if s.dtype == "int64"), tuple(s for s in specs if s.dtype != "int64"))
    run = onnx_runner(ctx.staging / FP32_GRAPH, threads=ctx.jobs.cpu_threads())
    report = compare(FP32_GRAPH, run, reference, ctx.cases, tolerances_for("fp32", ctx.graph.output_names),
                     case_progress("validate", ctx.model.config, ctx.cases, ctx.progress))
    report.raise_if_failed()
    graph = GraphRecord(FP32_GRAPH, "fp32", TARGET_INFO["onnxruntime"].runtimes, graph_opset(ctx.staging / FP32_GRAPH),
                        report)
    return io, graph, reference


def write_bundle(ctx: Context, options: ExportOptions, io: IO, graphs: list[GraphRecord], fp16: fp16_mod.Fp16Outcome | None,
                 engine: EngineOutcome | None, int8: int8_stage.Int8Outcome | None = None) -> Manifest:
    """Side files, Triton repository, and the sealed manifest."""
    from mbert.export.triton.writer import record_of, spec_for, write_triton_repository
    from mbert.modeling.checkpoint import copy_side_files

    cfg, resolved = ctx.model.config, ctx.model.source
    copy_side_files(resolved.path, ctx.staging)
    manifest = Manifest(
        format_version=2, name=ctx.target.name, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        source=Source(ctx.source, str(resolved.path), resolved.hub_id, resolved.revision),
        tool_versions=_tool_versions(), task=cfg.task,
        labels={str(k): v for k, v in cfg.id2label.items()} or None, model=model_info(cfg),
        max_seq_len=ctx.max_len, io=io, pooling=ctx.pooling, graphs=tuple(graphs),
        precision=(replace(fp16.record, naive_fp16_tensorrt=engine.naive) if engine else fp16.record) if fp16 else None,
        engine=engine.record if engine else None, int8=int8.record if int8 else None)
    spec = spec_for(manifest, max_batch=options.max_batch, encoder=options.triton_encoder)
    write_triton_repository(ctx.staging, spec)
    return write(ctx.staging, replace(manifest, triton=record_of(spec)))


def _tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime

    from mbert.export import __version__

    return {"mbert-export": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}
