"""INT8 for CPU serving, proven safe like FP16: which matrices, measured one at a time.

ONNX Runtime's dynamic quantization (``onnxruntime.quantization.quantize_dynamic``) turns a
``MatMul`` with a constant weight into ``DynamicQuantizeLinear`` + ``MatMulInteger`` (fused by the
CPU EP into one ``DynamicQuantizeMatMul``): the activation is scaled at run time, per tensor, to
uint8 (asymmetric: ``scale = (max(x, 0) - min(x, 0)) / 255``, zero point ``round(-min / scale)``),
the weight is int8 with one symmetric scale per output channel, the product is summed in int32 and
rescaled to FP32. Everything else (LayerNorm, softmax, attention products, GeGLU) stays FP32.

Weight format (measured, ``tests/test_int8.py::test_full_range_weights_saturate_without_vnni``):
ONNX Runtime's U8S8 kernel on x86 CPUs without VNNI (AVX2, AVX-512 core) multiplies with
``vpmaddubsw``, which saturates a pair of products at 32767; full-range int8 weights (+-127, what
sentence-transformers/optimum's ``avx512_vnni`` config and ``quantize_dynamic``'s default write)
overflow it (255 * 127 * 2 = 64770), so the same graph gives different, wrong numbers on a
non-VNNI CPU (10% relative error on a Gaussian 2048 x 768 x 2304 product on this AVX2 machine).
We write 7-bit weights (``reduce_range``, +-64: 255 * 64 * 2 = 32640 fits): the product is then
exact int32 arithmetic on every CPU, VNNI or not, with the same kernel and speed, for one bit of
weight precision that the sensitivity plan and the validation below account for.

The plan (:func:`measure` then :func:`plan`): quantizing one matrix at a time is emulated in the
eager FP32 model with ONNX Runtime's exact arithmetic (:func:`int8_linear`, checked against
ONNX Runtime in the tests), so 4 x 22 quantized variants cost forward passes, not 88 graphs: each
calibration text runs once in FP32 keeping every layer's input, and each matrix of layer L re-runs
only layers L.. (encoder checkpoints; head checkpoints re-run the whole model). The damage of a
matrix is how far quantizing it alone moves each output (1 - cosine, worst calibration text);
matrices are taken cheapest first while the summed damage stays within the budget, the combined
choice is then measured (not assumed additive) and shrunk until it fits, and what stays FP32 says
why. The graph is finally checked for real in ONNX Runtime on the validation grid
(:mod:`mbert.export.int8_check`).
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mbert.modeling.errors import PrecisionError
from mbert.modeling.model import encoder_of, global_bias, local_bias, rope_tables

# Validation thresholds (1 - cosine allowed at the worst case of the grid) per output; see
# int8_check.INT8_TOLERANCES for their reasons. The plan spends a fraction of each.
GATE = {"sentence_embedding": 0.005, "last_hidden_state": 0.02, "logits": 0.005}
# The plan's budget is half the gate: the calibration texts are not the grid (other lengths, padded
# batches whose padding widens the per-tensor activation range) and summed damages only estimate
# the combined one; the other half is the margin the real ONNX Runtime validation must fit in.
PLAN_SHARE = 0.5
PLAN_MAX_LEN = 512  # calibration texts are cut here for the sensitivity passes (cost; see measure)
LAYER_MATRICES = ("attn.Wqkv", "attn.Wo", "mlp.Wi", "mlp.Wo")
HEAD_MATRICES = ("head.dense", "decoder", "classifier")


@dataclass(frozen=True)
class WeightFormat:
    """How weights are stored: int8, symmetric per output channel, ``[-qmax, qmax]``."""

    name: str
    qmax: int
    reduce_range: bool  # the quantize_dynamic flag that gives this range

    @property
    def note(self) -> str:
        return {"s8-7bit": "7-bit weights (+-64): exact on every x86 CPU (no vpmaddubsw saturation)",
                "s8": "8-bit weights (+-127): exact only with VNNI/AMX; saturates on AVX2/AVX-512 core"}[self.name]


S8_7BIT = WeightFormat("s8-7bit", 64, True)  # ours
S8 = WeightFormat("s8", 127, False)  # sentence-transformers / optimum "avx512_vnni", quantize_dynamic default
FORMATS = {f.name: f for f in (S8_7BIT, S8)}


@dataclass(frozen=True)
class Site:
    """One weight matrix: ``layer`` None for head matrices; ``module`` as in ``mbert.export.scopes``."""

    layer: int | None
    module: str

    @property
    def name(self) -> str:
        return self.module if self.layer is None else f"layers.{self.layer}.{self.module}"


def matrix_sites(model: nn.Module) -> list[tuple[Site, nn.Linear]]:
    """Every matrix product with a weight, in forward order (layers, then the head)."""
    enc = encoder_of(model)
    out = []
    for i, layer in enumerate(enc.layers):
        for m in LAYER_MATRICES:
            out.append((Site(i, m), layer.get_submodule(m)))
    if model is not enc:
        for m in HEAD_MATRICES:
            try:
                linear = model.get_submodule(m)
            except AttributeError:
                continue
            if isinstance(linear, nn.Linear):
                out.append((Site(None, m), linear))
    return out


# --- ONNX Runtime's dynamic INT8 arithmetic, emulated -------------------------------------------------

def quantize_weight(weight: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> (integer values as float [N, K], scale [N]) exactly as ONNX Runtime's
    quantizer writes the transposed initializer [K, N] per channel (axis -1): the scale is
    ``2 * absmax / (2 * qmax)`` in float64, stored float32 (1.0 for an all-zero channel); values are
    ``round_half_even(w / scale)`` in float32, clipped to int8."""
    w = weight.detach().float()
    absmax = w.double().abs().amax(dim=1)
    scale64 = 2.0 * absmax / (2 * fmt.qmax)
    scale = torch.where(scale64 < torch.finfo(torch.float32).tiny, torch.ones_like(scale64), scale64).float()
    q = torch.clamp(torch.round(w / scale[:, None]), -128, 127)
    return q, scale


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ONNX Runtime's ``DynamicQuantizeLinear`` on the whole tensor: (uint8 values as float, scale, zero point)."""
    x = x.float()
    zero = torch.zeros((), dtype=torch.float32)
    lo, hi = torch.minimum(x.min(), zero), torch.maximum(x.max(), zero)
    scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 255.0)
    zp = torch.round(torch.clamp(0.0 - lo / scale, 0.0, 255.0))
    q = torch.clamp(torch.round(x / scale) + zp, 0.0, 255.0)
    return q, scale, zp


def int8_linear(x: torch.Tensor, linear: nn.Linear, fmt: WeightFormat,
                weight: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``linear(x)`` as ``DynamicQuantizeMatMul`` computes it: int32 sums (exact here in float64),
    scaled by ``activation_scale * weight_scale[n]`` in float32, plus the FP32 bias."""
    qw, sw = weight if weight is not None else quantize_weight(linear.weight, fmt)
    qx, sx, zx = quantize_activation(x)
    acc = torch.matmul((qx - zx).double(), qw.double().t())  # exact integers
    out = acc.float() * (sx * sw)
    if linear.bias is not None:
        out = out + linear.bias.float()
    return out.to(x.dtype)


@contextlib.contextmanager
def emulated(model: nn.Module, sites: Iterable[Site], fmt: WeightFormat):
    """Inside the block, the given matrices of ``model`` compute as ONNX Runtime's INT8 would
    (forward hooks replacing their outputs; removed on exit)."""
    wanted = set(sites)
    hooks = []
    try:
        for site, linear in matrix_sites(model):
            if site in wanted:
                qw = quantize_weight(linear.weight, fmt)
                hooks.append(linear.register_forward_hook(
                    lambda mod, args, out, qw=qw: int8_linear(args[0], mod, fmt, qw)))
        yield
    finally:
        for h in hooks:
            h.remove()


# --- sensitivity -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Damage:
    """How far outputs moved: per output name, 1 - cosine at the worst calibration text
    (pooled outputs: the text's vector; token outputs: the text's worst token)."""

    by_output: dict[str, float]

    def load(self, budget: dict[str, float]) -> float:
        """The largest fraction of its budget any output uses (> 1: over budget)."""
        return max(v / budget[k] for k, v in self.by_output.items())


@dataclass
class SensitivityReport:
    fmt: str
    outputs: list[str]
    sites: list[Site]
    solo: list[Damage]  # quantizing that matrix alone
    num_texts: int
    num_tokens: int
    max_len: int
    seconds: float


def _damage(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for name, want in ref.items():
        g, w = got[name].double().reshape(-1, want.shape[-1]), want.double().reshape(-1, want.shape[-1])
        cos = F.cosine_similarity(g, w, dim=-1, eps=1e-30)
        out[name] = float((1.0 - cos).max()) if torch.isfinite(g).all() else float("inf")
    return out


def _worst(acc: dict[str, float], new: dict[str, float]) -> dict[str, float]:
    return {k: max(acc.get(k, 0.0), v) for k, v in new.items()}


def _tail(graph: nn.Module, start: int, x: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """The encoder checkpoint's outputs from the residual stream ``x`` entering layer ``start``
    (layers start.. then final_norm and the graph's own pooling), as ``ModernBertModel.forward``
    runs them; ``tests/test_int8.py`` checks that start=0 equals the full forward."""
    enc = encoder_of(graph.model)
    T = ids.shape[1]
    kinds = {True: (rope_tables(T, enc.global_inv_freq), global_bias(mask)),
             False: (rope_tables(T, enc.local_inv_freq), local_bias(mask, enc.window))}
    for layer in enc.layers[start:]:
        (cos, sin), bias = kinds[layer.attn.is_global]
        x = layer(x, cos, sin, bias)
    hidden = enc.final_norm(x.to(enc.final_norm.weight.dtype)).float()
    out = {"last_hidden_state": hidden}
    if graph.pooling is not None:
        out["sentence_embedding"] = graph.pooling(hidden, mask)
    return out


def _outputs(graph: nn.Module, ids, mask) -> dict[str, torch.Tensor]:
    out = graph(ids, mask)
    out = out if isinstance(out, tuple) else (out,)
    return {n: o.float() for n, o in zip(graph.output_names, out)}


@torch.no_grad()
def measure(graph: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
            fmt: WeightFormat = S8_7BIT, progress=None, sites: Sequence[Site] | None = None) -> SensitivityReport:
    """Damage of quantizing each matrix (``sites``, default all) alone, on one-text batches (no
    padding to skew the per-tensor activation range). ``graph``: the exporter's ``GraphModule`` on
    the FP32 model."""
    model = graph.model
    enc = encoder_of(model)
    if enc.final_norm.weight.dtype != torch.float32:
        raise PrecisionError("the INT8 sensitivity plan needs the FP32 model (load it with dtype=None)")
    sites = list(sites) if sites is not None else [s for s, _ in matrix_sites(model)]
    solo: dict[Site, dict[str, float]] = {s: {} for s in sites}
    cached_tail = graph.task == "encoder"
    t0, tokens, max_len = time.perf_counter(), 0, 0
    for n, (ids, mask) in enumerate(batches):
        tokens, max_len = tokens + int(mask.sum()), max(max_len, ids.shape[1])
        inputs: list[torch.Tensor] = []
        hooks = [layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in enc.layers]
        try:
            ref = _outputs(graph, ids, mask)
        finally:
            for h in hooks:
                h.remove()
        for site in sites:
            with emulated(model, [site], fmt):
                got = (_tail(graph, site.layer, inputs[site.layer], ids, mask)
                       if cached_tail and site.layer is not None else _outputs(graph, ids, mask))
            solo[site] = _worst(solo[site], _damage(ref, got))
        if progress:
            progress(n + 1, len(batches))
    names = list(graph.output_names)
    return SensitivityReport(fmt.name, names, sites, [Damage(solo[s]) for s in sites], len(batches), tokens,
                             max_len, time.perf_counter() - t0)


@torch.no_grad()
def combined_damage(graph: nn.Module, batches, sites: Iterable[Site], fmt: WeightFormat) -> Damage:
    """Damage of quantizing all ``sites`` together (emulated), worst over ``batches``."""
    worst: dict[str, float] = {}
    sites = list(sites)
    for ids, mask in batches:
        ref = _outputs(graph, ids, mask)
        with emulated(graph.model, sites, fmt):
            worst = _worst(worst, _damage(ref, _outputs(graph, ids, mask)))
    return Damage(worst)


# --- the plan --------------------------------------------------------------------------------------

@dataclass
class MatrixDecision:
    site: str
    layer: int | None
    module: str
    damage: dict[str, float]  # alone
    precision: str  # "int8" or "float32"
    why: str


@dataclass
class Int8Plan:
    fmt: str
    budget: dict[str, float]
    matrices: list[MatrixDecision]
    combined: dict[str, float] = field(default_factory=dict)  # measured damage of the chosen set
    checks: int = 0  # combined measurements made
    cost_s: dict[str, float] = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)

    def int8_sites(self) -> list[Site]:
        return [Site(m.layer, m.module) for m in self.matrices if m.precision == "int8"]

    def fp32_sites(self) -> list[Site]:
        return [Site(m.layer, m.module) for m in self.matrices if m.precision != "int8"]

    def to_dict(self) -> dict:
        return {"weight_format": self.fmt, "weight_format_note": FORMATS[self.fmt].note, "budget": self.budget,
                "gate": {k: GATE[k] for k in self.budget}, "plan_share": PLAN_SHARE,
                "combined_damage": self.combined, "combined_checks": self.checks, "cost_s": self.cost_s,
                "calibration": self.calibration, "matrices": [asdict(m) for m in self.matrices]}

    @classmethod
    def from_dict(cls, d: dict) -> "Int8Plan":
        return cls(d["weight_format"], d["budget"], [MatrixDecision(**m) for m in d["matrices"]],
                   d.get("combined_damage", {}), d.get("combined_checks", 0), d.get("cost_s", {}),
                   d.get("calibration", {}))


def budget_for(outputs: Sequence[str]) -> dict[str, float]:
    return {name: GATE[name] * PLAN_SHARE for name in outputs}


def plan(report: SensitivityReport, check=None) -> Int8Plan:
    """Which matrices run INT8. A matrix whose damage alone exceeds the budget stays FP32. The others
    are taken cheapest first: without ``check``, while their summed damage fits the budget; with
    ``check(sites) -> Damage`` (the measured damage of quantizing ``sites`` together), the longest
    cheapest-first prefix whose measured damage fits (bisection, started from the summed estimate)."""
    budget = budget_for(report.outputs)
    order = sorted(range(len(report.sites)), key=lambda i: (report.solo[i].load(budget), i))
    why: dict[int, str] = {}
    candidates = []
    for i in order:
        d = report.solo[i]
        if d.load(budget) > 1.0:
            worst = max(d.by_output, key=lambda k: d.by_output[k] / budget[k])
            why[i] = f"alone moves {worst} by {d.by_output[worst]:.2e} > budget {budget[worst]:.2e}"
        else:
            candidates.append(i)
    total, estimate = {k: 0.0 for k in budget}, 0
    for i in candidates:
        total = {k: total[k] + report.solo[i].by_output[k] for k in total}
        if max(total[k] / budget[k] for k in total) > 1.0:
            break
        estimate += 1
    combined, checks, k = {}, 0, estimate
    if check is not None and candidates:
        k, combined, checks = _longest_fitting_prefix(report, candidates, budget, check, estimate)
    chosen = set(candidates[:k])
    late = ("adding it (cheapest first) pushed the measured combined damage past the budget" if check is not None
            else "its damage would push the summed damage past the budget (cheaper matrices took it)")
    decisions = []
    for i, site in enumerate(report.sites):
        ok = i in chosen
        decisions.append(MatrixDecision(site.name, site.layer, site.module, report.solo[i].by_output,
                                        "int8" if ok else "float32", "within budget" if ok else why.get(i, late)))
    return Int8Plan(report.fmt, budget, decisions, combined, checks,
                    calibration={"texts": report.num_texts, "tokens": report.num_tokens, "max_len": report.max_len})


def _longest_fitting_prefix(report, candidates: list[int], budget, check, estimate: int):
    """(k, measured damage of prefix k, checks made): the largest k with a fitting measured damage,
    assuming damage grows with the prefix. All candidates are tried first, then the summed estimate,
    then bisection between what fits and what does not."""
    def fits(k):
        d = check([report.sites[i] for i in candidates[:k]])
        return d.load(budget) <= 1.0, d.by_output

    ok, d = fits(len(candidates))
    if ok:
        return len(candidates), d, 1
    checks, best = 1, {k: 0.0 for k in budget}
    lo, hi = 0, len(candidates) - 1  # prefix lo fits (0 trivially), prefix hi + 1 does not
    if estimate > 0:
        ok, d = fits(estimate)
        checks += 1
        if ok:
            lo, best = estimate, d
        else:
            hi = estimate - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok, d = fits(mid)
        checks += 1
        if ok:
            lo, best = mid, d
        else:
            hi = mid - 1
    return lo, best, checks


# --- int8.json -------------------------------------------------------------------------------------

def save_int8(path: Path, plan_: Int8Plan, validation: dict | None = None, graph: dict | None = None) -> None:
    data = {"plan": plan_.to_dict()}
    if graph is not None:
        data["graph"] = graph
    if validation is not None:
        data["validation"] = validation
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def load_int8(path: Path) -> tuple[Int8Plan, dict]:
    """The plan and the whole document of an ``int8.json``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return Int8Plan.from_dict(data["plan"]), data
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PrecisionError(f"{path}: not a valid int8.json ({exc})") from exc


def plan_table(plan_: Int8Plan) -> list[tuple[str, ...]]:
    """Rows (layer, matrix, damage per output..., runs in, why) for printing."""
    names = list(plan_.budget)
    rows = []
    for m in plan_.matrices:
        rows.append(("-" if m.layer is None else str(m.layer), m.module,
                     *(f"{m.damage[n]:.2e}" if n in m.damage else "-" for n in names), "INT8" if m.precision == "int8" else "FP32",
                     "" if m.precision == "int8" else m.why))
    return rows


def plan_headers(plan_: Int8Plan) -> tuple[str, ...]:
    return ("layer", "matrix", *(f"1-cos {n}" for n in plan_.budget), "runs in", "why")
