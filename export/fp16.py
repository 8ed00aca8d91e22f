"""The FP16 stages of the pipeline: scan, plan, mixed-precision graph, FP16 validation (ours beside a
naive all-FP16 conversion), and the TensorRT engine when TensorRT and a GPU are present."""
from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mbert.modeling.model import encoder_of

from .onnx import GraphModule, to_onnx
from .precision import plan as make_plan
from .precision import save_precision, scan, scan_batches, scan_table, to_mixed_precision
from .validate import Case, Tolerance, compare, onnx_runner

# Mixed FP16 graph vs FP32 eager. FP16 keeps 11 significant bits, so per-token vectors agree to
# ~1e-4 in cosine after 22 layers; the pooled embedding averages that noise away. 0.9999 pooled
# is the contract for "the same embedding"; a token cosine under 0.999 means a region
# broke (overflow, lost mask), not rounding.
FP16_TOLERANCES = {
    "sentence_embedding": Tolerance(atol=float("inf"), rtol=0.0, min_cosine=0.9999,
                                    reason="pooled FP16 vs FP32: cosine >= 0.9999 is the contract"),
    "last_hidden_state": Tolerance(atol=float("inf"), rtol=0.0, min_cosine=0.999,
                                   reason="per-token FP16 rounding; < 0.999 means a broken region"),
    "logits": Tolerance(atol=float("inf"), rtol=0.0, min_cosine=0.9999,
                        reason="head logits FP16 vs FP32: cosine >= 0.9999"),
}


@dataclass
class Fp16Outcome:
    validation: dict
    summary: dict
    engine: dict | None
    scan_rows: list = field(default_factory=list)
    plan: dict | None = None
    engine_note: str = ""


def run_fp16(model, pooling, tokenizer, texts, cases, reference, tmp: Path, max_len: int, options, stages) -> Fp16Outcome:
    report = stages.run("scan", scan, model, scan_batches(tokenizer, texts, max_len))
    plan = make_plan(report, options.margin)
    mixed = to_mixed_precision(model, plan)
    stages.run("mixed precision", to_onnx, mixed, tmp / "model.fp16.onnx", pooling=pooling, opset=options.opset,
               max_seq_len=max_len)
    names = GraphModule(model, pooling).output_names
    tolerances = {n: FP16_TOLERANCES[n] for n in names}

    def validate_both():
        ours = compare("model.fp16.onnx", onnx_runner(tmp / "model.fp16.onnx"), reference, cases, tolerances)
        naive = naive_report(tmp / "model.onnx", reference, cases, tolerances)
        kinds = per_layer_kind(model, mixed, [c for c in cases if c.input_ids.shape[1] <= 512])
        return ours, naive, kinds

    ours, naive, kinds = stages.run("validate fp16", validate_both)
    validation = {**ours.to_dict(), "naive_fp16": naive, "per_layer_kind": kinds}
    save_precision(tmp / "precision.json", report, plan, validation)
    from .plot import plot_scan

    plot_scan(report, plan, tmp / "precision.png")
    ours.raise_if_failed()
    summary = {
        "plan": "precision.json",
        "plot": "precision.png",
        "margin": plan.margin,
        "fp32_layers": plan.fp32_layers(),
        "decisions": [f"layer {d.layer}: {d.site} {d.max_abs:.4g} -> {d.precision}" for d in plan.decisions],
        "max_abs_seen": max(s.max_abs for s in report.stats),
    }
    engine, note = stages.run("engine", build_engine_stage, tmp, max_len, options, cases)
    return Fp16Outcome(validation, summary, engine, scan_table(report, plan), plan.to_dict(), note)


def naive_report(fp32_onnx: Path, reference, cases, tolerances) -> dict:
    """The same validation on a naive all-FP16 conversion of the FP32 graph: onnxruntime's float16
    converter with IO kept FP32, what a user would otherwise run. Shown beside ours, never gating."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "naive.fp16.onnx"
        try:
            with warnings.catch_warnings():  # it warns about every constant it clamps
                warnings.simplefilter("ignore")
                converted = convert_float_to_float16(onnx.load(str(fp32_onnx)), keep_io_types=True)
            onnx.save(converted, str(path))
            return compare("naive fp16 (onnxruntime float16 converter)", onnx_runner(path), reference, cases,
                           tolerances).to_dict()
        except Exception as exc:  # the naive path failing is a finding, not an export error
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


@torch.no_grad()
def per_layer_kind(model, mixed, cases: list[Case]) -> dict:
    """Worst per-token cosine and max abs error of each layer's output (mixed eager vs FP32 eager),
    grouped by layer kind (global / local)."""
    enc, menc = encoder_of(model), encoder_of(mixed)
    worst = {"global": [1.0, 0.0], "local": [1.0, 0.0]}
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
            cos = float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) if torch.isfinite(b).all() else -1.0
            err = float((a - b).abs().max()) if torch.isfinite(b).all() else float("inf")
            worst[kind] = [min(worst[kind][0], cos), max(worst[kind][1], err)]
    return {k: {"worst_cosine": v[0], "max_abs_error": v[1]} for k, v in worst.items()}


def build_engine_stage(bundle_dir: Path, max_len: int, options, cases) -> tuple[dict | None, str]:
    """Build ``model.plan`` when TensorRT and a GPU exist; otherwise say why, in one line."""
    from .tensorrt import build_engine, profiles_from, tensorrt_available

    target = Path(options.out) if options.out else Path("engines") / bundle_dir.name
    later = f"build it later on a GPU machine from this bundle with: mbert-export --engine-only {target}"
    if not options.engine:
        return None, f"no TensorRT engine (--no-engine); {later}"
    ok, reason = tensorrt_available()
    if not ok:
        return None, f"no TensorRT engine: {reason}; {later}"
    profiles = profiles_from(options.max_batch, max_len, options.opt_batch, options.opt_seq_len, options.split_seq)
    cache = (target.parent / ".trt-timing.cache")
    info = build_engine(bundle_dir / "model.fp16.onnx", bundle_dir / "model.plan", profiles,
                        workspace_gib=options.workspace_gib, timing_cache_path=cache)
    info["validation"] = validate_engine(bundle_dir, cases).to_dict()
    return info, f"TensorRT {info.get('tensorrt_version')} engine built for {info.get('gpu_name')}"


def validate_engine(bundle_dir: Path, cases):
    """The engine against the bundle's FP32 ONNX graph on ONNX Runtime (the eager model's proven twin)."""
    from .tensorrt import TensorRTRunner

    runner = TensorRTRunner(bundle_dir / "model.plan")

    def run(ids: np.ndarray, mask: np.ndarray):
        return {k: np.asarray(v) for k, v in runner.run(input_ids=ids, attention_mask=mask).items()}

    reference = onnx_runner(bundle_dir / "model.onnx")
    names = list(reference(cases[0].input_ids, cases[0].attention_mask))
    report = compare("model.plan", run, reference, cases, {n: FP16_TOLERANCES[n] for n in names})
    report.raise_if_failed()
    return report
