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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from mbert.bundle import GraphRecord, IO, Manifest, Source, model_info, write
from mbert.bundle.texts import calibration_texts, load_text_file
from mbert.bundle.validation import Case, ValidationReport, build_cases, compare, default_grid, tolerances_for
from mbert.modeling import load_model, load_pooling
from mbert.modeling.errors import ExportError, OptionError
from mbert.modeling.graph import GraphModule
from mbert.modeling.pooling import PoolingConfig
from mbert.modeling.random import is_random
from mbert.modeling.tokenizer import check_token_ids, load_tokenizer

from . import fp16 as fp16_mod
from . import int8_stage
from .background import Jobs
from .engine import EngineOutcome, engine_stage
from .device import resolve_device
from .lowering import TARGET_INFO
from .onnx import graph_opset, to_onnx
from .progress import Progress, ProgressFn, case_progress
from .reference import ReferenceOutputs
from .options import ExportOptions
from .runners import onnx_runner
from .transaction import check_target, transaction

# (event, message); events: "stage", "done", "started" (a stage that started a background job),
# "background" ("NAME: WALL s wall, CPU s CPU": that job's own times, once collected), "info", "warn", "progress"
Reporter = Callable[[str, str], None]
FP32_FILE = "model.onnx"


@dataclass
class Context:
    """What every stage reads: the checked options and the loaded checkpoint."""

    source: str
    options: ExportOptions
    target: Path  # where the bundle will be
    staging: Path  # where its files are written until the swap
    model: torch.nn.Module
    pooling: PoolingConfig | None
    tokenizer: object
    max_len: int
    texts: list[str]  # built-in texts plus the user's calibration file
    cases: list[Case] = field(default_factory=list)  # the validation grid on real text
    reference: ReferenceOutputs | None = None  # set by the validate stage: eager FP32 outputs, cached per case
    device: torch.device = torch.device("cpu")  # where the eager passes run (--device)
    progress: ProgressFn | None = None  # progress records of long stages
    jobs: Jobs | None = None  # the traces running in a child process (set by export_bundle)

    @property
    def graph(self) -> GraphModule:
        return GraphModule(self.model, self.pooling).eval()


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
    target = options.target(source)
    check_target(target, options.overwrite)
    texts = calibration_texts() + (load_text_file(options.calibration) if options.calibration else [])
    stages = _Stages(report, 4 + (4 if options.fp16 else 0) + (3 if options.int8 else 0))
    with transaction(target, options.overwrite, lambda m: report("info", m)) as staging, Jobs(report) as jobs:
        ctx = stages.run("load", load, str(source), options, target, staging, texts)
        ctx.device, ctx.jobs, ctx.progress = device, jobs, _progress(report, jobs)
        if is_random(ctx.model.source.path):
            report("warn", f"{source} has RANDOM weights (written by --random-checkpoint): fine for trying the tool, "
                           "meaningless as a model")
        stages.run("trace", trace, ctx, background=True)  # collected by validate
        fp16 = engine = plan = scan_report = mixed = None
        if options.fp16:
            scan_report, plan = stages.run("scan", fp16_mod.scan_and_plan, ctx)
            # in the background beside validate; collected by validate fp16
            mixed = stages.run("mixed precision", fp16_mod.trace_mixed, ctx, plan, background=True)
        io, fp32_graph = stages.run("validate", validate, ctx)
        graphs = [fp32_graph]
        if options.fp16:
            fp16 = stages.run("validate fp16", fp16_mod.validate_mixed, ctx, scan_report, plan, mixed)
            graphs.append(fp16.graph)
            engine = stages.run("engine", engine_stage, staging, target, ctx.max_len, options, ctx.cases,
                                lambda message: report("progress", f"engine: {message}"))
        int8 = None
        if options.int8:  # independent of --fp16: the CPU path
            sensitivity = stages.run("int8 sensitivity", int8_stage.sensitivity, ctx)
            chosen = stages.run("int8 plan", int8_stage.choose, ctx, sensitivity)
            int8 = stages.run("int8 blind", int8_stage.finish, ctx, chosen)
            graphs.append(int8.graph)
        manifest = stages.run("write", write_bundle, ctx, io, graphs, fp16, engine, int8)
    return ExportResult(target, manifest, stages.timings, fp16, engine.note if engine else "", int8)


def _check_builder(options: ExportOptions) -> None:
    """An engine family named explicitly must be able to build here: fail before any work, not
    after the trace and the scan (``auto`` falls back to no engine with a note instead)."""
    if not options.fp16 or options.family not in ("tensorrt", "tensorrt-rtx"):
        return
    from mbert.runtime.trt_family import builder_available

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


def load(source: str, options: ExportOptions, target: Path, staging: Path, texts: list[str]) -> Context:
    """Config, options against it, tokenizer and ids, pooling, then the weights (strict, finite)."""
    from mbert.modeling import resolve
    from mbert.modeling.config import ModernBertConfig

    folder = resolve(source).path
    cfg = ModernBertConfig.from_file(folder / "config.json")
    if options.task is not None:
        cfg = cfg.with_task(options.task)
    pooling = load_pooling(folder) if cfg.task == "encoder" else None
    max_len = options.max_len_for(cfg, pooling.max_seq_length if pooling else None)
    tokenizer = load_tokenizer(folder)
    check_token_ids(cfg, tokenizer, folder / "tokenizer.json")
    model = load_model(source, task=options.task)
    ctx = Context(source, options, target, staging, model, pooling, tokenizer, max_len, texts)
    ctx.cases = build_cases(tokenizer, texts, default_grid(cfg.window_half_width, max_len),
                            cfg.cls_token_id, cfg.sep_token_id, cfg.pad_token_id)
    return ctx


def trace(ctx: Context) -> None:
    """Start tracing ``model.onnx`` in the background: the FP32 graph in ONNX Runtime's form (fused
    attention, ``mbert.export.lowering``). :func:`validate` collects it."""
    ctx.jobs.start("trace", to_onnx, ctx.model, ctx.staging / FP32_FILE, pooling=ctx.pooling,
                   opset=ctx.options.opset, max_seq_len=ctx.max_len, target="onnxruntime")


def validate_graph(ctx: Context, file: str, precision: str, stage: str) -> ValidationReport:
    """``file`` of the staging folder on ONNX Runtime against the eager FP32 model, on the grid."""
    run = onnx_runner(ctx.staging / file, threads=ctx.jobs.cpu_threads() if ctx.jobs else None)
    report = compare(file, run, ctx.reference, ctx.cases, tolerances_for(precision, ctx.graph.output_names),
                     case_progress(stage, ctx.model.config, ctx.cases, ctx.progress))
    report.raise_if_failed()
    return report


def validate(ctx: Context) -> tuple[IO, GraphRecord]:
    """The eager reference outputs (on --device, while a trace may still run), then ``model.onnx``
    (waiting for its trace) against them."""
    ctx.reference = ReferenceOutputs(ctx.graph, device=ctx.device).precompute(ctx.cases, ctx.progress)
    specs = ctx.jobs.collect("trace")
    io = IO(tuple(s for s in specs if s.dtype == "int64"), tuple(s for s in specs if s.dtype != "int64"))
    report = validate_graph(ctx, FP32_FILE, "fp32", "validate")
    return io, GraphRecord(FP32_FILE, "fp32", TARGET_INFO["onnxruntime"].runtimes,
                           graph_opset(ctx.staging / FP32_FILE), report)


def write_bundle(ctx: Context, io: IO, graphs: list[GraphRecord], fp16: fp16_mod.Fp16Outcome | None,
                 engine: EngineOutcome | None, int8: int8_stage.Int8Outcome | None = None) -> Manifest:
    """Side files, Triton repository, and the sealed manifest."""
    from mbert.modeling.checkpoint import copy_side_files

    from .triton import record_of, spec_for, write_triton_repository

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
    spec = spec_for(manifest, max_batch=ctx.options.max_batch, encoder=ctx.options.triton_encoder)
    write_triton_repository(ctx.staging, spec)
    return write(ctx.staging, replace(manifest, triton=record_of(spec)))


def _tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime

    from . import __version__

    return {"mbert-export": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}
