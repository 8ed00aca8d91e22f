"""The FP16 stages of the pipeline: scan and plan, the mixed-precision graph, and its validation
(ours beside a naive all-FP16 conversion, which is reported and never gates)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mbert.bundle import GraphRecord, LayerKindError, PrecisionRecord
from mbert.bundle.names import FP16_GRAPH, FP16_PLAN, FP16_PLOT
from mbert.bundle.schema import to_json
from mbert.bundle.tensors import Runner
from mbert.bundle.validation import Case, compare, tolerances_for
from mbert.export.context import Context
from mbert.export.fp16.naive import naive_report
from mbert.export.fp16.precision import Plan, ScanReport, save_precision, scan, scan_batches, to_mixed_precision
from mbert.export.fp16.precision import plan as make_plan
from mbert.export.onnx.lowering import TARGET_INFO
from mbert.export.onnx.trace import graph_opset, to_onnx
from mbert.export.progress import ProgressFn, case_progress
from mbert.modeling.model import encoder_of
from mbert.runtime.backends.onnxruntime import onnx_runner


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


def scan_and_plan(ctx: Context) -> tuple[ScanReport, Plan]:
    report = scan(ctx.model, scan_batches(ctx.tokenizer, ctx.texts, ctx.max_len), device=ctx.device,
                  progress=ctx.progress)
    return report, make_plan(report, ctx.margin)


def trace_mixed(ctx: Context, plan: Plan) -> MixedStarted:
    """Start tracing ``model.fp16.onnx`` (TensorRT's form) in the background, once the FP32 trace is
    done (one trace at a time; :func:`validate_mixed` collects it), and meanwhile measure the mixed
    eager model's error per layer kind (eager work for the core the trace leaves free)."""
    ctx.jobs.collect("trace")
    mixed = to_mixed_precision(ctx.model, plan)  # converted once: the child traces it, the parent checks it
    ctx.jobs.start("mixed precision", to_onnx, mixed, ctx.staging / FP16_GRAPH, pooling=ctx.pooling,
                   opset=ctx.opset, max_seq_len=ctx.max_len, target="tensorrt")
    short = [c for c in ctx.cases if c.input_ids.shape[1] <= 512]
    return MixedStarted(per_layer_kind(ctx.model, mixed, short, ctx.progress))


def validate_mixed(ctx: Context, reference: Runner, report: ScanReport, plan: Plan, started: MixedStarted) -> Fp16Outcome:
    """The mixed graph against the eager FP32 model (gating), the naive conversion (reported), the
    per-layer-kind error of the mixed eager model; precision.json and precision.png written."""
    from mbert.export.fp16.plot import plot_scan

    kinds = started.per_layer_kind
    ctx.jobs.collect("mixed precision")
    tolerances = tolerances_for("fp16", ctx.graph.output_names)
    config = ctx.model.config
    ours = compare(FP16_GRAPH, onnx_runner(ctx.staging / FP16_GRAPH), reference, ctx.cases, tolerances,
                   case_progress("validate fp16", config, ctx.cases, ctx.progress))
    naive, naive_error = naive_report(ctx.staging / FP16_GRAPH, reference, ctx.cases, tolerances,
                                      case_progress("naive fp16", config, ctx.cases, ctx.progress))
    save_precision(ctx.staging / FP16_PLAN, report, plan,
                   to_json({"ours": ours, "naive_fp16": naive, "naive_fp16_error": naive_error, "per_layer_kind": kinds}))
    plot_scan(report, plan, ctx.staging / FP16_PLOT)
    ours.raise_if_failed()
    record = PrecisionRecord(
        plan=FP16_PLAN, plot=FP16_PLOT, margin=plan.margin, fp32_layers=tuple(plan.fp32_layers()),
        decisions=tuple(f"{'model' if d.layer is None else f'layer {d.layer}'}: {d.site} {d.max_abs:.4g} -> "
                        f"{d.precision}" for d in plan.decisions),
        max_abs_seen=max(s.max_abs for s in report.stats), per_layer_kind=kinds,
        naive_fp16=naive, naive_fp16_error=naive_error)
    graph = GraphRecord(FP16_GRAPH, "fp16", TARGET_INFO["tensorrt"].runtimes, graph_opset(ctx.staging / FP16_GRAPH),
                        ours)
    return Fp16Outcome(graph, record, report, plan)


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
