"""FP16 that is proven safe: scan, plan, mixed precision.

``scan(model, texts)`` runs the eager FP32 model over calibration text and records, per layer
and per site where FP16 could overflow, the max |x| and a high percentile. ``plan(report)``
decides what stays FP32: matrix products in FP16; softmax and LayerNorm statistics always in
FP32 (the arithmetic says so: exp-sums over 8192 keys and squared activations leave FP16's range
or precision regardless of the data, and the cost is a handful of element-wise ops); the residual
stream, attention or MLP of a layer in FP32 exactly where the scan measured a value above
``65504 / margin``. ``to_mixed_precision(model, plan)`` returns the eager model with those
dtypes; traced with ``mbert.export.onnx.trace.to_onnx`` it becomes ``model.fp16.onnx`` with an explicit
``Cast`` at every boundary (precision lives in the graph, as strongly typed TensorRT needs).

The attention scores (site ``attn.scores``, the FP16 tensor the TensorRT form computes before its
FP32 softmax) are never materialized by the model's fused attention: the scan gets q and k from
the ``scores`` probe and computes the max |q.k| over exactly the entries the graph computes (all
pairs in global layers, the 3-block neighbourhoods in local ones), in chunks. Where the
Cauchy-Schwarz bound max|q| max|k| is at most 65504/64 it records the bound instead, marked
``bound`` (no margin up to 64 can need FP32 below it; a bound can only make the plan more
conservative); ModernBERT's scores are far below it, so the exact pass (as costly as half of the
attention) runs only where it can change a decision.

Why the mixed graph is traced rather than rewritten: the eager model's precision follows its
weights (see ``mbert.modeling.model``), so the plan is applied once, to parameters, and the ONNX
graph, the PyTorch CUDA check and the plan cannot disagree; rewriting an exported graph would
mean matching node names to layers.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from mbert.bundle.errors import PrecisionError
from mbert.export.device import model_on, resolve_device
from mbert.export.progress import Meter, ProgressFn, forward_flops
from mbert.modeling.model import Probe, encoder_of

FP16_MAX = 65504.0
# 8x (three binary orders of magnitude) headroom by default: the scan sees a finite sample of
# text, activations grow with input length and content (gte-modernbert-base peaks at 81% of the
# FP16 limit on one 950-token input), fine-tunes shift magnitudes, and FP16 matmul accumulators
# can exceed the magnitude of the stored output. A site measured above 65504/8 = 8188 stays FP32.
DEFAULT_MARGIN = 8.0
PERCENTILE = 99.9
_SAMPLE = 1 << 16  # elements sampled (evenly strided) per tensor for the percentile: 65 above p99.9
_CHUNK = 1 << 25  # attention scores computed at once by the scan (128 MiB in FP32, one reused buffer)
# attn.scores is computed exactly only where its Cauchy-Schwarz bound max|q| max|k| exceeds this:
# below it no plan margin up to 64 can need FP32, and the bound itself is recorded (SiteStat.bound).
EXACT_SCORES_ABOVE = FP16_MAX / 64

# site -> which group of a layer it belongs to
LAYER_SITES = {
    "resid_in": "residual",  # the residual stream entering the layer
    "attn.Wqkv": "attention",  # Wqkv output
    "attn.scores": "attention",  # q k^T / sqrt(d) before masking: every entry the graph computes
    "attn.out": "attention",  # softmax(..) v, the input of Wo
    "attn.Wo": "attention",  # attention branch output
    "resid_attn": "residual",  # residual stream after attention (input of mlp_norm)
    "mlp.Wi": "mlp",  # Wi output (gate and up)
    "mlp.act": "mlp",  # act(g) * u, the input of mlp.Wo
    "mlp.Wo": "mlp",  # MLP branch output
    "resid_mlp": "residual",  # residual stream after the MLP (the layer's output)
}


@dataclass
class SiteStat:
    layer: int | None  # None for model-level sites
    site: str
    max_abs: float
    percentile: float  # the PERCENTILE-th percentile of |x|
    bound: bool = False  # max_abs is an upper bound (attn.scores below EXACT_SCORES_ABOVE), not a measurement

    @property
    def headroom(self) -> float:
        return FP16_MAX / self.max_abs if self.max_abs > 0 else float("inf")


@dataclass
class ScanReport:
    stats: list[SiteStat]
    num_texts: int
    num_tokens: int
    max_len: int
    percentile: float = PERCENTILE

    def get(self, layer: int | None, site: str) -> SiteStat:
        for s in self.stats:
            if s.layer == layer and s.site == site:
                return s
        raise KeyError((layer, site))

    def to_dict(self) -> dict:
        return {"num_texts": self.num_texts, "num_tokens": self.num_tokens, "max_len": self.max_len,
                "percentile": self.percentile, "stats": [asdict(s) for s in self.stats]}

    @classmethod
    def from_dict(cls, d: dict) -> "ScanReport":
        return cls([SiteStat(**s) for s in d["stats"]], d["num_texts"], d["num_tokens"], d["max_len"], d["percentile"])


def scan_batches(tokenizer, texts: Sequence[str], max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch per text (no padding), tokenized with ``tokenizer`` and truncated to ``max_len``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer.to_str())  # a private copy: padding off, our truncation
    tok.no_padding()
    tok.enable_truncation(max_len)
    batches = []
    for text in texts:
        ids = torch.tensor([tok.encode(text).ids], dtype=torch.int64)
        batches.append((ids, torch.ones_like(ids)))
    return batches


def _quantile(sample: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(sample, q)`` (linear interpolation) from the top order statistics only."""
    n = sample.numel()
    pos = q * (n - 1)  # ascending position
    lo = int(pos)
    top = sample.topk(n - lo).values  # descending: top[-1] is ascending[lo]
    if lo + 1 >= n:
        return top[-1]
    return top[-1] + (pos - lo) * (top[-2] - top[-1])


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """[max |x|, PERCENTILE of |x| over an evenly strided sample, 0 (measured, not a bound)] as an
    FP32 tensor on t's device (no copy of t, no device sync)."""
    if t.numel() == 0:
        return torch.zeros(3, device=t.device)
    lo, hi = torch.aminmax(t.detach())
    flat = t.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // _SAMPLE)][:_SAMPLE].abs().float()
    zero = torch.zeros((), device=t.device)
    return torch.stack((torch.maximum(hi.float(), -lo.float()), _quantile(sample, PERCENTILE / 100), zero))


def score_stats(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``tensor_stats(q @ k^T)`` without materializing the scores.

    The percentile comes from an evenly spaced grid of (query, key) pairs in every head (and
    block), about ``_SAMPLE`` scores in all, computed as a small matmul. The max: the
    Cauchy-Schwarz bound ``max |q_i| * max |k_j|`` per head (and block), recorded as such (third
    entry 1) when it is at most ``EXACT_SCORES_ABOVE``; otherwise the exact max, from the scores
    in chunks of queries.
    """
    q, k = q.detach(), k.detach()
    lq, lk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    n_batch = q.numel() // max(1, lq * d)
    if n_batch * lq * lk == 0:
        return torch.zeros(3, device=q.device)
    per = max(1, _SAMPLE // n_batch)  # sampled entries per head (and block): an evenly spaced grid
    n_rows = min(lq, max(1, round(per**0.5)))
    n_cols = min(lk, max(1, per // n_rows))
    q2, k2 = q.reshape(n_batch, lq, d), k.reshape(n_batch, lk, d)
    rows_q, rows_k = q2[:, :: lq // n_rows][:, :n_rows], k2[:, :: lk // n_cols][:, :n_cols]
    grid = rows_q.float() @ rows_k.float().transpose(-1, -2)  # [N, n_rows, n_cols]
    pct = _quantile(grid.reshape(-1).abs(), PERCENTILE / 100)
    bound = (torch.linalg.vector_norm(q.float(), dim=-1).amax(-1)
             * torch.linalg.vector_norm(k.float(), dim=-1).amax(-1)).max()
    if float(bound) <= EXACT_SCORES_ABOVE:  # one sync per call; exact work only where it can matter
        return torch.stack((bound, pct, torch.ones((), device=q.device)))
    kt = k2.transpose(-1, -2).contiguous()  # [N, d, Lk]
    rows = max(1, _CHUNK // (n_batch * lk))
    buf = torch.empty(n_batch * min(rows, lq) * lk, dtype=torch.promote_types(q.dtype, k.dtype), device=q.device)
    best = torch.zeros((), device=q.device)
    for start in range(0, lq, rows):
        chunk = q2[:, start : start + rows]
        out = buf[: chunk.numel() // d * lk].view(n_batch, chunk.shape[1], lk)
        torch.matmul(chunk, kt, out=out)  # reused buffer: no fresh pages per chunk
        lo, hi = torch.aminmax(out)
        best = torch.maximum(best, torch.maximum(hi.float(), -lo.float()))
    return torch.stack((best, pct, torch.zeros((), device=q.device)))


def _merge(prev: torch.Tensor | None, stats: torch.Tensor) -> torch.Tensor:
    """Running [max, percentile, bound flag]: the flag follows whichever max is larger."""
    if prev is None:
        return stats
    flag = torch.where(stats[0] > prev[0], stats[2], prev[2])
    return torch.stack((torch.maximum(prev[0], stats[0]), torch.maximum(prev[1], stats[1]), flag))


@torch.no_grad()
def scan(model: nn.Module, texts_or_batches: Sequence, max_len: int | None = None, *,
         device: str | torch.device | None = None, progress: ProgressFn | None = None) -> ScanReport:
    """Max |x| and a high percentile at every FP16-sensitive site of the FP32 ``model``.

    ``texts_or_batches``: strings (tokenized with the checkpoint's own ``tokenizer.json``, one text
    per batch, truncated to ``max_len`` or the model's max positions) or (ids, mask) batches. One
    text per batch means no padding, so padded positions cannot inflate or hide a value.
    ``device``: where the forward passes run (``auto``: CUDA when available; default: where the
    model is). ``progress`` gets a record per text, with an ETA from the FLOPs done so far.
    """
    if encoder_of(model).final_norm.weight.dtype != torch.float32:
        raise PrecisionError("scan needs the FP32 model (load it with dtype=None)")
    model = model_on(model, resolve_device(device) if device is not None else next(model.parameters()).device)
    run_device = next(model.parameters()).device
    batches = list(texts_or_batches)
    if batches and isinstance(batches[0], str):
        from mbert.bundle.tokenizer import load_tokenizer

        max_len = max_len or model.config.max_position_embeddings
        batches = scan_batches(load_tokenizer(model.source.path), batches, max_len)
    encoder = encoder_of(model)
    acc: dict[tuple[int | None, str], torch.Tensor] = {}

    def record(key, stats: torch.Tensor):
        acc[key] = _merge(acc.get(key), stats)

    def out_hook(key):
        return lambda mod, args, out: record(key, tensor_stats(out))

    def in_hook(key):
        return lambda mod, args: record(key, tensor_stats(args[0]))

    def scores_hook(key):
        return lambda mod, args: record(key, score_stats(*args))

    hooks = []
    for i, layer in enumerate(encoder.layers):
        hooks += [
            layer.register_forward_pre_hook(in_hook((i, "resid_in"))),
            layer.attn.Wqkv.register_forward_hook(out_hook((i, "attn.Wqkv"))),
            layer.attn.scores.register_forward_pre_hook(scores_hook((i, "attn.scores"))),
            layer.attn.Wo.register_forward_pre_hook(in_hook((i, "attn.out"))),
            layer.attn.Wo.register_forward_hook(out_hook((i, "attn.Wo"))),
            layer.mlp_norm.register_forward_pre_hook(in_hook((i, "resid_attn"))),
            layer.mlp.Wi.register_forward_hook(out_hook((i, "mlp.Wi"))),
            layer.mlp.Wo.register_forward_pre_hook(in_hook((i, "mlp.act"))),
            layer.mlp.Wo.register_forward_hook(out_hook((i, "mlp.Wo"))),
            layer.register_forward_hook(out_hook((i, "resid_mlp"))),
        ]
    hooks += [
        encoder.embeddings.tok_embeddings.register_forward_hook(out_hook((None, "embeddings"))),
        encoder.final_norm.register_forward_pre_hook(in_hook((None, "final_norm.input"))),
    ]
    assert sum(isinstance(m, Probe) for m in encoder.modules()) == len(encoder.layers)
    lengths = [int(ids.shape[1]) for ids, _ in batches]
    costs = [forward_flops(encoder.config, n) for n in lengths]  # the ETA's unit of work
    meter = Meter("scan", sum(costs), progress)
    tokens = 0
    try:
        for n, ((ids, mask), cost) in enumerate(zip(batches, costs), 1):
            model(ids.to(run_device), mask.to(run_device))
            tokens += int(mask.sum())
            meter.advance(cost, f"text {n}/{len(batches)} ({ids.shape[1]} tokens)")
    finally:
        for h in hooks:
            h.remove()
    site_order = {s: n for n, s in enumerate(["embeddings", *LAYER_SITES, "final_norm.input"])}
    position = {"embeddings": -1, "final_norm.input": len(encoder.layers)}  # model-level sites

    def forward_order(key):
        layer, site = key
        return (position[site] if layer is None else layer, site_order[site])

    keys = sorted(acc, key=forward_order)
    values = torch.stack([acc[k] for k in keys]).cpu().tolist() if keys else []  # one device sync
    stats = [SiteStat(k[0], k[1], v[0], v[1], bool(v[2])) for k, v in zip(keys, values)]
    return ScanReport(stats, len(batches), tokens, max(lengths, default=0))


@dataclass
class LayerPlan:
    layer: int
    residual: str = "float16"
    attention: str = "float16"
    mlp: str = "float16"


@dataclass
class Decision:
    layer: int | None
    site: str
    max_abs: float
    precision: str
    why: str


@dataclass
class Plan:
    margin: float
    layers: list[LayerPlan]
    final_norm: str = "float16"
    decisions: list[Decision] = field(default_factory=list)
    always_fp32: tuple[str, ...] = ("softmax statistics", "LayerNorm statistics", "RoPE tables", "outputs")

    @property
    def limit(self) -> float:
        return FP16_MAX / self.margin

    def fp32_layers(self) -> list[int]:
        return [lp.layer for lp in self.layers if "float32" in (lp.residual, lp.attention, lp.mlp)]

    def to_dict(self) -> dict:
        return {"margin": self.margin, "limit": self.limit, "final_norm": self.final_norm,
                "always_fp32": list(self.always_fp32),
                "layers": [asdict(lp) for lp in self.layers], "decisions": [asdict(d) for d in self.decisions]}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(d["margin"], [LayerPlan(**lp) for lp in d["layers"]], d["final_norm"],
                   [Decision(**x) for x in d["decisions"]], tuple(d["always_fp32"]))


def plan(report: ScanReport, margin: float = DEFAULT_MARGIN) -> Plan:
    """FP32 exactly where a measured max |x| exceeds 65504 / margin; FP16 everywhere else."""
    if not margin >= 1:
        raise PrecisionError(f"margin must be >= 1 (a fraction of the FP16 range), got {margin}")
    limit = FP16_MAX / margin
    n_layers = 1 + max(s.layer for s in report.stats if s.layer is not None)
    layers = [LayerPlan(i) for i in range(n_layers)]
    decisions = []
    for s in report.stats:
        if s.max_abs <= limit:
            continue
        what_max = "upper bound of max |x|" if s.bound else "max |x|"
        why = f"{what_max} {s.max_abs:.4g} > 65504/{margin:g} = {limit:.4g} (headroom {s.headroom:.2f}x)"
        if s.layer is None:
            if s.site == "final_norm.input":
                layers[-1].residual = "float32"
                decisions.append(Decision(None, s.site, s.max_abs, "float32", why + ": final norm input and last residual"))
                continue
            raise PrecisionError(f"{s.site} reaches {s.max_abs:.4g}: the embedding table itself does not fit FP16 with margin {margin:g}")
        group = LAYER_SITES[s.site]
        setattr(layers[s.layer], group, "float32")
        what = {"residual": "residual stream and its LayerNorms", "attention": "attention (Wqkv, scores, Wo)",
                "mlp": "MLP (Wi, act, Wo)"}[group]
        decisions.append(Decision(s.layer, s.site, s.max_abs, "float32", f"{why}: {what} of layer {s.layer} in FP32"))
        if s.site == "resid_in" and s.layer > 0:  # the value was produced by the previous layer
            layers[s.layer - 1].residual = "float32"
    final = "float32" if layers[-1].residual == "float32" else "float16"
    return Plan(margin, layers, final, decisions)


def to_mixed_precision(model: nn.Module, plan_: Plan) -> nn.Module:
    """A copy of the FP32 eager model with every parameter in the dtype the plan gives it."""
    if len(plan_.layers) != len(encoder_of(model).layers):
        raise PrecisionError(f"the plan has {len(plan_.layers)} layers, the model {len(encoder_of(model).layers)}")
    mixed = copy.deepcopy(model)
    dt = {"float16": torch.float16, "float32": torch.float32}
    enc = encoder_of(mixed)
    for module in mixed.modules():  # heads, embeddings: matrices FP16 (statistics stay FP32 inside)
        for name, p in module.named_parameters(recurse=False):
            p.data = p.data.to(torch.float16)
    for lp, layer in zip(plan_.layers, enc.layers):
        for norm in (layer.attn_norm, layer.mlp_norm):
            for p in norm.parameters():
                p.data = p.data.to(dt[lp.residual])
        for p in layer.attn.parameters():
            p.data = p.data.to(dt[lp.attention])
        for p in layer.mlp.parameters():
            p.data = p.data.to(dt[lp.mlp])
    enc.embeddings.norm.weight.data = enc.embeddings.norm.weight.data.to(dt[plan_.layers[0].residual])
    enc.final_norm.weight.data = enc.final_norm.weight.data.to(dt[plan_.final_norm])
    for norm in (enc.embeddings.norm, enc.final_norm):
        if norm.bias is not None:
            norm.bias.data = norm.bias.data.to(norm.weight.dtype)
    return mixed.eval()


def save_precision(path: Path, report: ScanReport, plan_: Plan, validation: dict | None = None) -> None:
    data = {"scan": report.to_dict(), "plan": plan_.to_dict()}
    if validation is not None:
        data["validation"] = validation
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def load_precision(path: Path) -> tuple[ScanReport, Plan]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return ScanReport.from_dict(data["scan"]), Plan.from_dict(data["plan"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PrecisionError(f"{path}: not a valid precision.json ({exc})") from exc
