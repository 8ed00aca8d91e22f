"""``mbert-run info``: what a bundle holds, how it was validated, and what can run it here."""
from __future__ import annotations

from mbert.bundle import Bundle


def table(rows, headers) -> str:
    """Plain text columns (the command lines' one table format)."""
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def describe(bundle: Bundle, *, verified: bool, source=None) -> str:
    from . import backends

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
    rows = [(g.file, *r) for g in m.graphs for r in g.validation.table()]
    if m.precision is not None and m.precision.naive_fp16 is not None:
        rows += [("naive fp16 (reference)", *r) for r in m.precision.naive_fp16.table()]
    if m.engine is not None and m.engine.validation is not None:
        rows += [(m.engine.file, *r) for r in m.engine.validation.table()]
    out.append("\nValidation at export (against the eager FP32 model):")
    out.append(table(rows, ("artifact", "output", "max abs err", "worst cosine", "verdict", "worst case")))
    if m.engine is not None:
        e = m.engine
        out.append(f"\nTensorRT engine {e.file}: TensorRT {e.tensorrt_version}, {e.gpu_name} (compute capability "
                   f"{e.compute_capability}), profiles " + "; ".join(str(p) for p in e.profiles))
    out.append("\nBackends on this machine:")
    statuses = backends.backend_statuses(bundle, source)
    out.append(table([(s.name, "yes" if s.usable else "no", s.reason) for s in statuses],
                     ("backend", "usable", "detail")))
    usable = [s.name for s in statuses if s.usable and s.name != "eager"]
    out.append(f"auto picks: {usable[0] if usable else 'nothing (install onnxruntime)'}")
    return "\n".join(out)
