"""The FP16 stages of the pipeline: scan and plan, the mixed-precision graph, and its validation
(ours beside a naive all-FP16 conversion, which is reported and never gates)."""
from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mbert.bundle import GraphRecord, LayerKindError, PrecisionRecord
from mbert.bundle.schema import to_json
from mbert.bundle.validation import Case, ValidationReport, compare, tolerances_for
from mbert.modeling.model import encoder_of

from .lowering import TARGET_INFO
from .onnx import graph_opset, to_onnx
from .progress import ProgressFn, case_progress
from .precision import Plan, ScanReport, plan as make_plan, save_precision, scan, scan_batches, to_mixed_precision
from .runners import onnx_runner

if TYPE_CHECKING:
    from .pipeline import Context

FP16_FILE = "model.fp16.onnx"


@dataclass(frozen=True)
class MixedStarted:
    """The mixed-precision stage's outcome: its trace runs in the background; the per-layer-kind
    error of the mixed eager model was measured meanwhile."""

    per_layer_kind: dict[str, LayerKindError]


@dataclass(frozen=True)
class Fp16Outcome:
    graph: GraphRecord
    record: PrecisionRecord
    scan: ScanReport
    plan: Plan


def scan_and_plan(ctx: "Context") -> tuple[ScanReport, Plan]:
    report = scan(ctx.model, scan_batches(ctx.tokenizer, ctx.texts, ctx.max_len), device=ctx.device,
                  progress=ctx.progress)
    return report, make_plan(report, ctx.options.margin)


def trace_mixed(ctx: "Context", plan: Plan) -> MixedStarted:
    """Start tracing ``model.fp16.onnx`` (TensorRT's form) in the background, once the FP32 trace is
    done (one trace at a time; :func:`validate_mixed` collects it), and meanwhile measure the mixed
    eager model's error per layer kind (eager work for the core the trace leaves free)."""
    ctx.jobs.collect("trace")
    mixed = to_mixed_precision(ctx.model, plan)  # converted once: the child traces it, the parent checks it
    ctx.jobs.start("mixed precision", to_onnx, mixed, ctx.staging / FP16_FILE, pooling=ctx.pooling,
                   opset=ctx.options.opset, max_seq_len=ctx.max_len, target="tensorrt")
    short = [c for c in ctx.cases if c.input_ids.shape[1] <= 512]
    return MixedStarted(per_layer_kind(ctx.model, mixed, short, ctx.progress))


def validate_mixed(ctx: "Context", report: ScanReport, plan: Plan, started: MixedStarted) -> Fp16Outcome:
    """The mixed graph against the eager FP32 model (gating), the naive conversion (reported), the
    per-layer-kind error of the mixed eager model; precision.json and precision.png written."""
    from .plot import plot_scan

    kinds = started.per_layer_kind
    ctx.jobs.collect("mixed precision")
    tolerances = tolerances_for("fp16", ctx.graph.output_names)
    config = ctx.model.config
    ours = compare(FP16_FILE, onnx_runner(ctx.staging / FP16_FILE), ctx.reference, ctx.cases, tolerances,
                   case_progress("validate fp16", config, ctx.cases, ctx.progress))
    naive, naive_error = naive_report(ctx.staging / FP16_FILE, ctx.reference, ctx.cases, tolerances,
                                      case_progress("naive fp16", config, ctx.cases, ctx.progress))
    save_precision(ctx.staging / "precision.json", report, plan,
                   to_json({"ours": ours, "naive_fp16": naive, "naive_fp16_error": naive_error, "per_layer_kind": kinds}))
    plot_scan(report, plan, ctx.staging / "precision.png")
    ours.raise_if_failed()
    record = PrecisionRecord(
        plan="precision.json", plot="precision.png", margin=plan.margin, fp32_layers=tuple(plan.fp32_layers()),
        decisions=tuple(f"{'model' if d.layer is None else f'layer {d.layer}'}: {d.site} {d.max_abs:.4g} -> "
                        f"{d.precision}" for d in plan.decisions),
        max_abs_seen=max(s.max_abs for s in report.stats), per_layer_kind=kinds,
        naive_fp16=naive, naive_fp16_error=naive_error)
    graph = GraphRecord(FP16_FILE, "fp16", TARGET_INFO["tensorrt"].runtimes, graph_opset(ctx.staging / FP16_FILE),
                        ours)
    return Fp16Outcome(graph, record, report, plan)


def naive_report(graph: Path, reference, cases, tolerances, on_case=None) -> tuple[ValidationReport | None, str | None]:
    """The same validation on the naive all-FP16 graph (:func:`write_naive_fp16` of ``graph``), what a
    user would otherwise run. Shown beside ours, never gating; (report, None), or (None, why) when
    the naive graph does not even run."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "naive.fp16.onnx"
        try:
            write_naive_fp16(graph, path)
            return compare("naive fp16 (onnxruntime float16 converter)", onnx_runner(path), reference, cases,
                           tolerances, on_case), None
        except Exception as exc:  # noqa: BLE001 - the naive path failing is a finding, not an export error
            return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def write_naive_fp16(graph: Path, path: Path) -> None:
    """The naive all-FP16 graph: onnxruntime's float16 converter on ``graph``, IO kept FP32.

    ``graph`` is a standard-ops graph of the model: the FP32 one, or the mixed FP16 graph (what the
    export passes: the FP32 ``model.onnx`` is in ONNX Runtime's fused form, which TensorRT cannot
    parse). The converter makes every float computation FP16, the plan's FP32 islands included (it
    rewrites ``Cast(to=FLOAT)`` into ``Cast(to=FLOAT16)``), so both give the same all-FP16 graph up
    to no-op casts; ``tests/test_precision.py`` checks that their outputs agree."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with warnings.catch_warnings():  # it warns about every constant it clamps
        warnings.simplefilter("ignore")
        converted = convert_float_to_float16(onnx.load(str(graph)), keep_io_types=True)
    onnx.save(converted, str(path))


@torch.no_grad()
def per_layer_kind(model, mixed, cases: list[Case], progress: ProgressFn | None = None) -> dict[str, LayerKindError]:
    """Worst per-token cosine and max abs error of each layer's output (mixed eager vs FP32 eager),
    grouped by layer kind (global / local); None where the mixed output was not finite."""
    enc, menc = encoder_of(model), encoder_of(mixed)
    worst = {"global": [1.0, 0.0], "local": [1.0, 0.0]}
    on_case = case_progress("per-layer error", model.config, cases, progress)
    for case in cases:
        ids, mask = torch.from_numpy(case.input_ids), torch.from_numpy(case.attention_mask)
        outs = {}
        hooks = [layer.register_forward_hook(lambda m, a, o, i=i, tag=tag: outs.__setitem__((tag, i), o.float()))
                 for tag, e in (("ref", enc), ("mix", menc)) for i, layer in enumerate(e.layers)]
        try:
            enc(ids, mask)
            menc(ids, mask)
        finally:
            for h in hooks:
                h.remove()
        keep = mask.bool()
        for i, layer in enumerate(enc.layers):
            kind = "global" if layer.attn.is_global else "local"
            a, b = outs[("ref", i)][keep], outs[("mix", i)][keep]
            if not torch.isfinite(b).all():
                worst[kind] = [None, None]
                continue
            if worst[kind][0] is None:
                continue
            cos = float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())
            worst[kind] = [min(worst[kind][0], cos), max(worst[kind][1], float((a - b).abs().max()))]
        if on_case is not None:
            on_case(case)
    return {k: LayerKindError(*v) for k, v in worst.items()}
