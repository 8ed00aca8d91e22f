"""INT8 for CPU serving, proven safe like FP16: which matrices, measured one at a time, then checked
together for real.

ONNX Runtime's dynamic quantization (``onnxruntime.quantization.quantize_dynamic``) turns a
``MatMul`` with a constant weight into ``DynamicQuantizeLinear`` + ``MatMulInteger`` (fused by the
CPU EP into one ``DynamicQuantizeMatMul``): the activation is scaled at run time, per tensor, to
uint8 (asymmetric: ``scale = (max(x, 0) - min(x, 0)) / 255``, zero point ``round(-min / scale)``),
the weight is int8 with one symmetric scale per output channel, the product is summed in int32 and
rescaled to FP32. Everything else (LayerNorm, softmax, attention products, GeGLU) stays FP32.

Weight format (measured, ``tests/test_int8.py::test_seven_bit_weights_are_exact_on_worst_case_inputs``
and ``benchmarks/int8_cpu.py``'s probe): ONNX Runtime's U8S8 kernel on x86 CPUs without VNNI (AVX2,
AVX-512 core) multiplies with ``vpmaddubsw``, which saturates a pair of products at 32767;
full-range int8 weights (+-127, what sentence-transformers/optimum's ``avx512_vnni`` config and
``quantize_dynamic``'s default write) overflow it (255 * 127 * 2 = 64770), so the same graph gives
different, wrong numbers on such a CPU (10% relative error on a Gaussian 2048 x 768 x 2304 product
on this AVX2 machine). We write 7-bit weights (``reduce_range``, +-64: 255 * 64 * 2 = 32640 fits):
exact int32 arithmetic on every CPU, VNNI or not, same kernel and speed, for one bit of weight
precision that the plan and the validation account for.

The plan, in three measured steps (:func:`measure`, :func:`select`):

1. Solo damage, emulated: each matrix quantized alone in the eager FP32 model with ONNX Runtime's
   exact arithmetic (:func:`int8_linear`, checked against ONNX Runtime in the tests); how far that
   moves every output (1 - cosine, worst calibration row). The FP32 run of each calibration batch
   is made once and kept (outputs and every layer's input), so the matrix of layer L re-runs only
   layers L.. (encoder checkpoints). The rows are short (the first :data:`SOLO_LEN` tokens of
   :data:`SOLO_ROWS` calibration texts, one batch as the runtime batches them): this step ranks
   matrices and finds the ones that cannot run INT8 at all, and what makes a matrix sensitive (an
   activation outlier channel stretching the per-tensor scale) is a property of channels, present in
   every token, so short rows show it at a fraction of the cost (a solo pass costs ~2L forward
   passes of the rows for L layers). A matrix over the budget alone stays FP32.
2. Combined damage, emulated on the same rows (FP32 references reused): the longest cheapest-first
   prefix of the remaining matrices whose measured (not summed) damage fits the budget.
3. End to end, for real: that set is quantized by ONNX Runtime and the graph is checked on the
   validation grid (every input length the bundle accepts, padded batches) with the gate's
   thresholds and the retrieval check (:mod:`mbert.export.int8.check`). If it misses, the most
   damaging matrices of the set go back to FP32 (bisection on the prefix, every candidate checked
   end to end) until a set passes; if none does, the export fails. The graph that ships is the one
   that passed.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mbert.bundle.errors import PrecisionError
from mbert.bundle.int8 import Int8Check, MatrixPlan
from mbert.bundle.validation import INT8_TOLERANCES
from mbert.modeling.model import encoder_of, global_bias, local_bias, rope_tables

# The plan's budget is half the gate (1 - min cosine of INT8_TOLERANCES) per output: the calibration
# rows are not the grid (other lengths, padded batches whose padding widens the per-tensor
# activation range); the other half is the margin the end-to-end check must fit in.
PLAN_SHARE = 0.5
SOLO_LEN = 32  # tokens per calibration row of the emulated passes ([CLS] text [SEP], cut)
SOLO_ROWS = 16  # calibration texts used, spread evenly over the built-in set and the user's file
LAYER_MATRICES = ("attn.Wqkv", "attn.Wo", "mlp.Wi", "mlp.Wo")
HEAD_MATRICES = ("head.dense", "decoder", "classifier")
_F32_EXACT = 2 ** 24  # float32 holds every integer up to this exactly


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


@dataclass(frozen=True)
class Site:
    """One weight matrix: ``layer`` None for head matrices; ``module`` as in ``mbert.export.onnx.scopes``."""

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


def budget_for(outputs: Sequence[str]) -> dict[str, float]:
    return {n: (1.0 - INT8_TOLERANCES[n].min_cosine) * PLAN_SHARE for n in outputs}


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


def integer_product(a: torch.Tensor, qw: torch.Tensor, qmax: int) -> torch.Tensor:
    """``a @ qw.T`` for integer-valued float tensors (``|a| <= 255``, ``|qw| <= qmax``), exact: in
    float32 over slices of K short enough that every partial sum stays below 2**24 (so no rounding,
    whatever the summation order), the slices added in float64."""
    step = _F32_EXACT // (255 * qmax)
    K = a.shape[-1]
    if K <= step:
        return torch.matmul(a, qw.t()).double()
    return sum(torch.matmul(a[..., i:i + step], qw[:, i:i + step].t()).double() for i in range(0, K, step))


def int8_linear(x: torch.Tensor, linear: nn.Linear, fmt: WeightFormat,
                weight: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``linear(x)`` as ``DynamicQuantizeMatMul`` computes it: exact int32 sums, scaled by
    ``activation_scale * weight_scale[n]`` in float32, plus the FP32 bias."""
    qw, sw = weight if weight is not None else quantize_weight(linear.weight, fmt)
    qx, sx, zx = quantize_activation(x)
    out = integer_product(qx - zx, qw, fmt.qmax).float() * (sx * sw)
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


# --- calibration rows and the FP32 reference ---------------------------------------------------------

def calibration_batches(tokenizer, texts: Sequence[str], length: int = SOLO_LEN,
                        rows: int = SOLO_ROWS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch: ``rows`` texts spread evenly over those of ``texts`` with at least ``length`` tokens,
    each cut to its first ``length`` ([CLS] .. [SEP]). No padding: a padded position would stretch the
    per-tensor activation range with values no output uses (short inputs are the end-to-end grid's)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer.to_str())  # a private copy: padding off, our truncation
    tok.no_padding()
    tok.enable_truncation(length)
    full = [e.ids for e in tok.encode_batch([t for t in texts if t.strip()]) if len(e.ids) == length]
    if not full:
        raise PrecisionError(f"no calibration text has {length} tokens: the INT8 plan needs some")
    n = min(rows, len(full))
    picked = [full[(i * len(full)) // n] for i in range(n)]
    return [(torch.tensor(picked, dtype=torch.int64), torch.ones((n, length), dtype=torch.int64))]


@dataclass
class Reference:
    """The FP32 run of each calibration batch, made once: outputs and every layer's input."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    outputs: list[dict[str, torch.Tensor]]
    layer_inputs: list[list[torch.Tensor]]

    @property
    def tokens(self) -> int:
        return sum(int(m.sum()) for _, m in self.batches)


def _outputs(graph: nn.Module, ids, mask) -> dict[str, torch.Tensor]:
    out = graph(ids, mask)
    out = out if isinstance(out, tuple) else (out,)
    return {n: o.float() for n, o in zip(graph.output_names, out)}


@torch.no_grad()
def fp32_reference(graph: nn.Module, batches) -> Reference:
    enc = encoder_of(graph.model)
    if enc.final_norm.weight.dtype != torch.float32:
        raise PrecisionError("the INT8 sensitivity plan needs the FP32 model (load it with dtype=None)")
    outputs, inputs = [], []
    for ids, mask in batches:
        seen: list[torch.Tensor] = []
        hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for layer in enc.layers]
        try:
            outputs.append(_outputs(graph, ids, mask))
        finally:
            for h in hooks:
                h.remove()
        inputs.append(seen)
    return Reference(list(batches), outputs, inputs)


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


def _damage(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    """1 - cosine per output at its worst row (pooled outputs) or token (token outputs); inf if not finite."""
    out = {}
    for name, want in ref.items():
        g, w = got[name].double().reshape(-1, want.shape[-1]), want.double().reshape(-1, want.shape[-1])
        cos = F.cosine_similarity(g, w, dim=-1, eps=1e-30)
        out[name] = float((1.0 - cos).max()) if torch.isfinite(g).all() else float("inf")
    return out


def _worst(acc: dict[str, float], new: dict[str, float]) -> dict[str, float]:
    return {k: max(acc.get(k, 0.0), v) for k, v in new.items()}


# --- step 1 and 2: emulated damage -------------------------------------------------------------------

@dataclass(frozen=True)
class SensitivityReport:
    fmt: str
    outputs: tuple[str, ...]
    sites: tuple[Site, ...]
    solo: tuple[dict[str, float], ...]  # per site: 1 - cosine per output, quantized alone
    rows: int
    tokens: int
    seconds: float

    def load(self, i: int, budget: dict[str, float]) -> float:
        """The largest fraction of its budget an output uses when site i is quantized alone."""
        return max(v / budget[k] for k, v in self.solo[i].items())


@torch.no_grad()
def measure(graph: nn.Module, ref: Reference, sites: Sequence[Site], fmt: WeightFormat = S8_7BIT,
            progress=None) -> SensitivityReport:
    """Damage of quantizing each of ``sites`` alone (step 1). ``graph``: the exporter's ``GraphModule``
    on the FP32 model; ``ref``: its :func:`fp32_reference` on the calibration batches. ``progress(done,
    total)`` after each (batch, site) pass."""
    t0 = time.perf_counter()
    tail = graph.task == "encoder"  # heads re-run the whole model (their head sits after the encoder)
    solo: dict[Site, dict[str, float]] = {s: {} for s in sites}
    total = len(ref.batches) * len(sites)
    for n, ((ids, mask), want, inputs) in enumerate(zip(ref.batches, ref.outputs, ref.layer_inputs)):
        for m, site in enumerate(sites, 1):
            with emulated(graph.model, [site], fmt):
                got = (_tail(graph, site.layer, inputs[site.layer], ids, mask)
                       if tail and site.layer is not None else _outputs(graph, ids, mask))
            solo[site] = _worst(solo[site], _damage(want, got))
            if progress:
                progress(n * len(sites) + m, total)
    return SensitivityReport(fmt.name, tuple(graph.output_names), tuple(sites), tuple(solo[s] for s in sites),
                             sum(len(b[0]) for b in ref.batches), ref.tokens, time.perf_counter() - t0)


@torch.no_grad()
def combined_damage(graph: nn.Module, ref: Reference, sites: Iterable[Site], fmt: WeightFormat) -> dict[str, float]:
    """Damage of quantizing all ``sites`` together (emulated), worst over the calibration batches."""
    worst: dict[str, float] = {}
    with emulated(graph.model, list(sites), fmt):
        for (ids, mask), want in zip(ref.batches, ref.outputs):
            worst = _worst(worst, _damage(want, _outputs(graph, ids, mask)))
    return worst


# --- step 3 and the decisions ----------------------------------------------------------------------

def longest_prefix(n: int, ok: Callable[[int], bool], guess: int | None = None) -> int:
    """The largest k in 0..n with ``ok(k)``, assuming ok holds up to some k and fails after: asks n,
    then ``guess``, then bisects between what passed and what failed; ``ok(0)`` is never asked.
    Whatever it returns (but 0) was asked and passed, so a wrong assumption can cost INT8 matrices,
    never correctness."""
    if n == 0 or ok(n):
        return n
    lo, hi = 0, n - 1  # ok(lo) holds (or lo == 0), ok(hi + 1) fails
    if guess is not None and 0 < guess < n:
        if ok(guess):
            lo = guess
        else:
            hi = guess - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Selection:
    """What the plan decided: ``matrices`` (every site, with its reason), the emulated damage of the
    set within budget, the end-to-end checks in the order they ran, and the chosen set (the one
    checked with ``len(chosen)`` matrices passed)."""

    matrices: tuple[MatrixPlan, ...]
    combined: dict[str, float]
    checks: tuple[Int8Check, ...]
    chosen: tuple[Site, ...]
    seconds: dict[str, float]


E2E = Callable[[Sequence[Site]], tuple[bool, str]]  # sites -> (passed, what missed)


def select(report: SensitivityReport, budget: dict[str, float], combined: Callable[[Sequence[Site]], dict[str, float]],
           end_to_end: E2E) -> Selection:
    """Steps 2 and 3 (see the module docstring). ``combined(sites)``: emulated damage of the set;
    ``end_to_end(sites)``: build and check the real graph. PrecisionError when no set passes."""
    t0 = time.perf_counter()
    order = sorted(range(len(report.sites)), key=lambda i: (report.load(i, budget), i))
    over = {i for i in order if report.load(i, budget) > 1.0}
    candidates = [report.sites[i] for i in order if i not in over]
    if not candidates:
        least = report.sites[order[0]]
        raise PrecisionError(f"no matrix can run INT8: each alone moves an output past the plan's budget "
                             f"({_fmt(budget)}); the least sensitive, {least.name}, moves "
                             f"{_fmt(report.solo[order[0]])}; export without --int8")
    measured: dict[int, dict[str, float]] = {}

    def fits(k: int) -> bool:
        measured[k] = combined(candidates[:k])
        return max(measured[k][o] / budget[o] for o in budget) <= 1.0

    summed, estimate = {o: 0.0 for o in budget}, 0
    for site in candidates:
        summed = {o: summed[o] + report.solo[report.sites.index(site)][o] for o in budget}
        if max(summed[o] / budget[o] for o in budget) > 1.0:
            break
        estimate += 1
    k_budget = longest_prefix(len(candidates), fits, estimate)
    t1 = time.perf_counter()
    if k_budget == 0:
        raise PrecisionError(f"no INT8 set fits the plan's budget {_fmt(budget)}: even the least sensitive "
                             f"matrix alone ({candidates[0].name}) measured {_fmt(measured[1])}")
    checks: list[Int8Check] = []

    def passes(k: int) -> bool:
        ok, detail = end_to_end(candidates[:k])
        checks.append(Int8Check(k, ok, "passed" if ok else detail))
        return ok

    k = longest_prefix(k_budget, passes)
    if k == 0:
        raise PrecisionError("no INT8 set passes the end-to-end check (grid and retrieval); tried "
                             + "; ".join(f"{c.int8_matrices} matrices: {c.detail}" for c in checks))
    missed = next((c.detail for c in reversed(checks) if not c.passed and c.int8_matrices > k), "")
    why = {}
    for i in over:
        d = report.solo[i]
        worst = max(d, key=lambda o: d[o] / budget[o])
        why[report.sites[i]] = f"alone moves {worst} by {d[worst]:.2e} > budget {budget[worst]:.2e}"
    for site in candidates[k_budget:]:
        why[site] = "the measured damage of the cheaper matrices together with it passes the budget"
    for site in candidates[k:k_budget]:
        why[site] = f"the end-to-end check missed with it ({missed})"
    matrices = tuple(MatrixPlan(s.name, s.layer, s.module, {o: finite_or_none(v) for o, v in report.solo[i].items()},
                                "fp32" if s in why else "int8", why.get(s, ""))
                     for i, s in enumerate(report.sites))
    return Selection(matrices, measured[k_budget], tuple(checks), tuple(candidates[:k]),
                     {"combined": t1 - t0, "end_to_end": time.perf_counter() - t1})


def finite_or_none(v: float) -> float | None:
    return v if v == v and abs(v) != float("inf") else None


def _fmt(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2e}" for k, v in d.items())
