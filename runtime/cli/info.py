"""``mbert-run info``: what a bundle holds, how it was validated, and what can run it here."""
from __future__ import annotations

from mbert.bundle import Bundle
from mbert.bundle.engine import LABELS
from mbert.bundle.int8 import plan_table, summary_lines


def table(rows, headers) -> str:
    """Plain text columns (the command lines' one table format)."""
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


# Lines of the builder log shown by ``info``: attention fusion and what the engine became.
BUILD_LOG_SHOWN = ("Self-Attention", "After Myelin optimization", "Total Activation Memory", "Engine Layer Information",
                   "Layer(")


def engine_lines(bundle: Bundle, max_log_lines: int = 12) -> list[str]:
    """The engine record, the precision walk per layer, and the build log's engine lines."""
    e = bundle.manifest.engine
    w = e.precision_walk
    opts = e.options
    built = f"on {e.built_on}" if e.built_on else "on a machine without a GPU"
    out = [f"\nTensorRT engine {e.file}: {e.label}, from {e.onnx}, built {built} in {e.build_seconds:.1f}s",
           f"  runs on   {e.runs_on()}",
           f"  status    {e.status}" + (f" on {e.validation.gpu}" if e.validation else f": {e.not_run_reason}"),
           "  profiles  " + "; ".join(str(p) for p in e.profiles),
           f"  builder   workspace limit {opts.workspace_gib:g} GiB, optimization level {opts.optimization_level}, "
           f"{'strongly typed' if opts.strongly_typed else 'weakly typed'}, TF32 {'on' if opts.tf32 else 'off'}"
           + (", hardware compatible (Ampere+)" if opts.hardware_compatible else "")
           + (", timing cache" if opts.timing_cache else ""),
           f"\nPrecision in TensorRT's network ({LABELS[w.family]} {w.version}, {w.onnx}): "
           f"{'passed' if w.passed else 'FAILED'}; compute layers fp16 {w.network.fp16_layers}, "
           f"FP32 {w.network.fp32_layers}; "
           f"kept FP32: {', '.join(w.fp32_sites) or 'none'} (details: {w.file})"]
    out.append(table(w.per_layer(), ("layer", "runs in (TensorRT)", "fp16 layers", "fp32 layers", "verdict")))
    log = bundle.path_of(e.build_log, "engine.build_log").read_text(encoding="utf-8").splitlines()
    shown = [line for line in log if not line.startswith("#") and any(topic in line for topic in BUILD_LOG_SHOWN)]
    out.append(f"\nBuild log ({e.build_log}), attention fusion and engine layers:")
    out += [f"  {line}" for line in shown[:max_log_lines]]
    if len(shown) > max_log_lines:
        out.append(f"  ... {len(shown) - max_log_lines} more in {e.build_log}")
    return out


def describe(bundle: Bundle, *, verified: bool, source=None) -> str:
    from mbert.runtime import backends

    m = bundle.manifest
    src, model, pooling = m.source, m.model, m.pooling
    out = [f"bundle      {bundle.path} ({'files verified' if verified else 'hashes NOT verified'}, "
           f"format {m.format_version}, sealed)",
           f"name        {m.name}   task {m.task}   created {m.created}",
           f"source      {src.id or src.path}" + (f"@{src.revision}" if src.revision else ""),
           f"model       hidden {model.hidden_size}, {model.num_hidden_layers} layers, "
           f"local attention {model.local_attention}, vocab {model.vocab_size}",
           f"max length  {m.max_seq_len} tokens (graph)",
           "outputs     " + ", ".join(f"{o.name} {list(o.shape)}" for o in m.io.outputs)]
    if pooling:
        prompts = ", ".join(f"{k}={v!r}" for k, v in pooling.prompts.items()) or "none"
        out.append(f"pooling     {pooling.mode}, normalize {pooling.normalize}, max_seq_length "
                   f"{pooling.max_seq_length}, include_prompt {pooling.include_prompt}; prompts: "
                   f"{prompts} (default {pooling.default_prompt_name})")
    if m.labels:
        out.append("labels      " + ", ".join(f"{k}={v}" for k, v in m.labels.items()))
    out.append("graphs      " + "; ".join(
        f"{g.file} ({g.precision}, opset {g.opset}, for {' and '.join(g.runtimes)}, "
        f"{m.files[g.file].bytes / 2**20:.1f} MB)" for g in m.graphs))
    if m.triton is not None:
        out.append(f"triton      {m.triton.repository}/: ensemble {m.triton.ensemble} -> {m.triton.encoder}, "
                   f"max batch {m.triton.max_batch}")
    out.append("built with  " + ", ".join(f"{k} {v}" for k, v in m.tool_versions.items()))
    if m.precision is not None:
        p = m.precision
        out.append(f"\nFP16 precision plan (margin {p.margin:g}x, max |x| seen {p.max_abs_seen:.4g}; FP16 max 65504): "
                   f"FP32 layers {list(p.fp32_layers) or 'none'}; details in {p.plan}, {p.plot}")
        out += [f"  {d}" for d in p.decisions]
    if m.int8 is not None:
        headers, plan_rows = plan_table(m.int8)
        out.append("")
        out += summary_lines(m.int8)
        out.append(table(plan_rows, headers))
    rows = [(g.file, *r) for g in m.graphs for r in g.validation.table()]
    if m.precision is not None and m.precision.naive_fp16 is not None:
        rows += [("naive fp16 (reference)", *r) for r in m.precision.naive_fp16.table()]
    if m.int8 is not None:
        rows += [(f"blind int8, {b.name} (reference)", *r) for b in m.int8.blind if b.validation is not None
                 for r in b.validation.table()]
    if m.engine is not None and m.engine.validation is not None:
        rows += [(m.engine.file, *r) for r in m.engine.validation.report.table()]
    out.append("\nValidation at export (against the eager FP32 model):")
    out.append(table(rows, ("artifact", "output", "max abs err", "worst cosine", "verdict", "worst case")))
    if m.precision is not None and m.precision.naive_fp16_tensorrt is not None:
        out.append("naive fp16 on TensorRT (reference): " + m.precision.naive_fp16_tensorrt.describe())
    if m.engine is not None:
        out += engine_lines(bundle)
    out.append("\nBackends on this machine:")
    statuses = backends.backend_statuses(bundle, source)
    out.append(table([(s.name, "yes" if s.usable else "no", s.reason) for s in statuses],
                     ("backend", "usable", "detail")))
    usable = [s.name for s in statuses if s.usable and s.name != "eager"]
    out.append(f"auto picks: {usable[0] if usable else 'nothing (install onnxruntime)'}")
    return "\n".join(out)
