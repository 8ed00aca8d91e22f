"""Parity on real text: the case grid, the comparison, and the report a bundle records.

The exporter runs it on every graph before calling the export done; the runtime runs the same
grid against the eager model on demand (``Encoder.check_parity``). Cases are real text through the
real tokenizer over a grid of batch sizes and lengths (one token, shorter than the window, around
the window edge, not a multiple of the block, several windows, heavily padded batches, long
inputs), capped at the bundle's max length. Every output gets a structured result: max abs error,
worst cosine, the case that produced it, and the tolerance it was judged by (stated where the
comparison is made). A miss fails.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from mbert.bundle.errors import ValidationError
from mbert.bundle.tokenizer import pad_batch

Runner = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Tolerance:
    """Pass when every row's cosine >= ``min_cosine`` and, when ``atol`` is set,
    ``|got - want| <= atol + rtol * |want|`` everywhere. ``reason`` says why these numbers."""

    atol: float | None
    rtol: float
    min_cosine: float
    reason: str

    def describe(self) -> str:
        bound = f"atol {self.atol:g}, rtol {self.rtol:g}, " if self.atol is not None else ""
        return f"{bound}cosine >= {self.min_cosine}"


# FP32 graph vs FP32 eager: identical arithmetic in another summation order. Measured differences
# are ~1e-5 on full-size random weights; the porting mistakes the tests inject move outputs by
# 1e-3 .. 4, so 1e-3 separates "same function" from "different function" with margin both ways.
FP32_TOLERANCE = Tolerance(atol=1e-3, rtol=1e-3, min_cosine=0.99999,
                           reason="FP32 vs FP32: only summation order differs (measured ~1e-5)")

# Mixed FP16 graph vs FP32 eager. FP16 keeps 11 significant bits, so per-token vectors agree to
# ~1e-4 in cosine after 22 layers; the pooled embedding averages that noise away. 0.9999 pooled
# is the contract for "the same embedding"; a token cosine under 0.999 means a region broke
# (overflow, lost mask), not rounding.
FP16_TOLERANCES = {
    "sentence_embedding": Tolerance(None, 0.0, 0.9999, "pooled FP16 vs FP32: cosine >= 0.9999 is the contract"),
    "last_hidden_state": Tolerance(None, 0.0, 0.999, "per-token FP16 rounding; < 0.999 means a broken region"),
    "logits": Tolerance(None, 0.0, 0.9999, "head logits FP16 vs FP32: cosine >= 0.9999"),
}


# Dynamic INT8 graph (``model.int8.onnx``) vs FP32 eager. Every quantized matrix product rounds its
# input to 1/255 of the whole tensor's range and its weights to 7 bits per channel, so per-token
# vectors carry ~1% noise and the pooled embedding averages most of it away. 0.995 pooled is the
# INT8 contract: an embedding an index built with FP32 vectors can still use (the export also checks
# that the top-10 neighbours of the built-in retrieval check agree); a token cosine under 0.98 means
# quantization broke a region (an activation outlier flattening the rest of its tensor), not rounding.
INT8_TOLERANCES = {
    "sentence_embedding": Tolerance(None, 0.0, 0.995, "pooled INT8 vs FP32: cosine >= 0.995 is the INT8 contract"),
    "last_hidden_state": Tolerance(None, 0.0, 0.98, "per-token INT8 rounding (~1%); < 0.98 means a broken region"),
    "logits": Tolerance(None, 0.0, 0.995, "head logits INT8 vs FP32: cosine >= 0.995"),
}


def tolerances_for(precision: str, names: Sequence[str]) -> dict[str, Tolerance]:
    """The stated tolerance of each output for a graph of ``precision`` ("fp32", "fp16" or "int8")."""
    if precision == "fp32":
        return {n: FP32_TOLERANCE for n in names}
    if precision in ("fp16", "int8"):
        table = FP16_TOLERANCES if precision == "fp16" else INT8_TOLERANCES
        return {n: table[n] for n in names}
    raise ValueError(f"no stated tolerance for precision {precision!r}")


@dataclass(frozen=True)
class Case:
    name: str
    input_ids: np.ndarray  # int64 [B, T]
    attention_mask: np.ndarray  # int64 [B, T]

    @property
    def lengths(self) -> list[int]:
        return self.attention_mask.sum(axis=1).astype(int).tolist()

    def describe(self) -> str:
        return f"{self.name} (lengths {self.lengths})"


@dataclass(frozen=True)
class OutputResult:
    """The worst an output did over the cases; errors are None where the output was not finite."""

    name: str
    max_abs_error: float | None
    worst_cosine: float | None
    worst_case: str
    finite: bool
    tolerance: Tolerance
    passed: bool

    def describe(self) -> str:
        if not self.finite:
            return f"{self.name}: NON-FINITE values at {self.worst_case}"
        return (f"{self.name}: max abs error {self.max_abs_error:.3g}, worst cosine {self.worst_cosine:.7f} "
                f"at {self.worst_case} (allowed {self.tolerance.describe()})")


@dataclass(frozen=True)
class ValidationReport:
    artifact: str
    cases: tuple[str, ...]
    outputs: tuple[OutputResult, ...]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def raise_if_failed(self) -> None:
        failed = [o for o in self.outputs if not o.passed]
        if failed:
            raise ValidationError(f"{self.artifact} does not match the eager model: "
                                  + "; ".join(o.describe() for o in failed))

    def table(self) -> list[tuple[str, str, str, str, str]]:
        """Rows (output, max abs err, worst cosine, verdict, worst case) for printing."""
        return [(o.name, _fmt(o.max_abs_error, ".2e"), _fmt(o.worst_cosine, ".7f"),
                 "pass" if o.passed else ("NON-FINITE" if not o.finite else "FAIL"), o.worst_case)
                for o in self.outputs]


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def default_grid(window: int, max_len: int) -> list[tuple[str, list[int]]]:
    """(name, per-row token lengths): the shapes where a blocked band attention can go wrong."""
    w = window  # half-width (64 for local_attention 128); the block size
    grid = [
        ("single token", [1]),
        ("shorter than the window", [w // 2 + 3]),
        ("window edge", [2 * w, 2 * w + 1, 2 * w + 2]),
        ("block edge", [w - 1, w, w + 1]),
        ("not a block multiple", [3 * w + 5]),
        ("several windows", [6 * (2 * w) + 7]),
        ("heavily padded 600+3", [600, 3]),
        ("heavily padded batch", [1000, 17, 3, 1]),
        ("long", [2048]),
    ]
    return [(name, [max(1, min(n, max_len)) for n in lengths]) for name, lengths in grid]


def build_cases(tokenizer, texts: Sequence[str], grid, cls_id: int | None, sep_id: int | None,
                pad_id: int) -> list[Case]:
    """Right-padded batches of real text cut to the grid's lengths ([CLS] text [SEP])."""
    pools = sorted((tokenizer.encode(t, add_special_tokens=False).ids for t in texts if t.strip()), key=len)
    joined = [i for p in pools for i in p]
    cases = []
    for c, (name, lengths) in enumerate(grid):
        rows = []
        for r, n in enumerate(lengths):
            body_len = max(0, n - 2)
            fitting = [p for p in pools if len(p) >= body_len]
            if fitting:
                body = fitting[(c + r) % len(fitting)][:body_len]
            else:
                body = (joined * (body_len // max(1, len(joined)) + 1))[:body_len]
            row = ([cls_id] if cls_id is not None else []) + body + ([sep_id] if n >= 2 and sep_id is not None else [])
            rows.append(row[:n])
        cases.append(Case(name, *pad_batch(rows, max(len(r) for r in rows), pad_id)))
    return cases


def grid_cases(tokenizer, model, max_len: int, texts: Sequence[str] | None = None) -> list[Case]:
    """The validation grid on real text, as every check of a bundle runs it: ``texts`` (default: the
    built-in set) cut to :func:`default_grid`'s lengths up to ``max_len``. ``model`` gives the window
    and the special ids (a manifest's ``ModelInfo`` or a ``ModernBertConfig``)."""
    from mbert.bundle.texts import calibration_texts

    return build_cases(tokenizer, calibration_texts() if texts is None else texts,
                       default_grid(model.local_attention // 2, max_len), model.cls_token_id, model.sep_token_id,
                       model.pad_token_id)


def compare(artifact: str, run: Runner, reference: Runner, cases: Sequence[Case],
            tolerances: dict[str, Tolerance],
            on_case: Callable[[Case], None] | None = None) -> ValidationReport:
    """Run ``run`` and ``reference`` on every case; judge each output by its stated tolerance.
    ``on_case`` (progress) is called with each case once it has been judged."""
    stats: dict[str, dict] = {}
    for case in cases:
        got, want = run(case.input_ids, case.attention_mask), reference(case.input_ids, case.attention_mask)
        keep = case.attention_mask.astype(bool)
        for name, tol in tolerances.items():
            if name not in want:
                continue
            g, w = np.asarray(got[name], dtype=np.float64), np.asarray(want[name], dtype=np.float64)
            if g.ndim == 3:  # token outputs: padded positions are undefined by contract
                g, w = g[keep], w[keep]
            s = stats.setdefault(name, dict(err=0.0, cos=1.0, worst="", finite=True, ok=True))
            finite = bool(np.isfinite(g).all())
            s["ok"] &= finite
            if not finite:
                if s["finite"]:
                    s["worst"] = case.describe()
                s["finite"] = False
                continue
            err, cos = float(np.abs(g - w).max()) if g.size else 0.0, _min_cosine(g, w)
            within = tol.atol is None or bool((np.abs(g - w) <= tol.atol + tol.rtol * np.abs(w)).all())
            s["ok"] &= within and cos >= tol.min_cosine
            if s["finite"] and (err > s["err"] or cos < s["cos"]):
                s["worst"] = case.describe()
            s["err"], s["cos"] = max(s["err"], err), min(s["cos"], cos)
        if on_case is not None:
            on_case(case)
    outputs = tuple(
        OutputResult(name, s["err"] if s["finite"] else None, s["cos"] if s["finite"] else None,
                     s["worst"] or cases[0].describe(), s["finite"], tolerances[name], s["ok"])
        for name, s in stats.items())
    return ValidationReport(artifact, tuple(c.describe() for c in cases), outputs)


def _min_cosine(g: np.ndarray, w: np.ndarray) -> float:
    g2, w2 = g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1])
    if not len(g2):
        return 1.0
    num = (g2 * w2).sum(-1)
    den = np.linalg.norm(g2, axis=-1) * np.linalg.norm(w2, axis=-1)
    return float((num / np.maximum(den, 1e-30)).min())
