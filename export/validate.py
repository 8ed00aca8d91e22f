"""Check an exported graph against the eager model on real text.

Cases are built from real text through the real tokenizer over a grid of batch sizes and lengths
(one token, shorter than the window, around the window edge, not a multiple of the block,
several windows, heavily padded batches, long inputs), capped at the bundle's max length.
Every output gets a structured result: max abs error, worst cosine, the case that produced it,
and the tolerance it was judged by (stated where the comparison is made). A miss fails.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from mbert.modeling.errors import TokenizerError, ValidationError


@dataclass(frozen=True)
class Tolerance:
    """Pass when ``|got - want| <= atol + rtol * |want|`` everywhere and every row's cosine >= min_cosine."""

    atol: float
    rtol: float
    min_cosine: float
    reason: str


# FP32 graph vs FP32 eager: identical arithmetic in another summation order. Measured differences
# are ~1e-5 on full-size random weights; the porting mistakes the tests inject move outputs by
# 1e-3 .. 4, so 1e-3 separates "same function" from "different function" with margin both ways.
FP32_TOLERANCE = Tolerance(atol=1e-3, rtol=1e-3, min_cosine=0.99999,
                           reason="FP32 vs FP32: only summation order differs (measured ~1e-5)")


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


@dataclass
class OutputResult:
    name: str
    max_abs_error: float
    worst_cosine: float
    worst_case: str
    finite: bool
    tolerance: Tolerance
    passed: bool

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tolerance"] = asdict(self.tolerance)
        return d


@dataclass
class ValidationReport:
    artifact: str
    outputs: list[OutputResult]
    cases: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def to_dict(self) -> dict:
        return {"artifact": self.artifact, "passed": self.passed, "cases": self.cases,
                "outputs": [o.to_dict() for o in self.outputs]}

    def raise_if_failed(self) -> None:
        failed = [o for o in self.outputs if not o.passed]
        if failed:
            detail = "; ".join(
                f"{o.name}: max abs error {o.max_abs_error:.3g}, worst cosine {o.worst_cosine:.7f}"
                f"{'' if o.finite else ', NON-FINITE values'} at {o.worst_case}"
                f" (allowed atol {o.tolerance.atol:g}, cosine >= {o.tolerance.min_cosine})"
                for o in failed
            )
            raise ValidationError(f"{self.artifact} does not match the eager model: {detail}")

    def table(self) -> list[tuple[str, str, str, str, str]]:
        rows = []
        for o in self.outputs:
            rows.append((o.name, f"{o.max_abs_error:.2e}", f"{o.worst_cosine:.7f}",
                         "pass" if o.passed else "FAIL", o.worst_case))
        return rows


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer.json not found; validation on real text needs the tokenizer")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise TokenizerError(f"{path}: unreadable tokenizer ({exc})") from exc


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
    out = []
    for name, lengths in grid:
        capped = [max(1, min(n, max_len)) for n in lengths]
        out.append((name, capped))
    return out


def build_cases(tokenizer, texts: Sequence[str], grid, cls_id: int, sep_id: int, pad_id: int) -> list[Case]:
    """Right-padded batches of real text cut to the grid's lengths ([CLS] text [SEP])."""
    pools = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts if t.strip()]
    pools.sort(key=len)
    joined = [i for p in pools for i in p]
    cases = []
    for c, (name, lengths) in enumerate(grid):
        rows = []
        for r, n in enumerate(lengths):
            body_len = max(0, n - 2)
            fitting = [p for p in pools if len(p) >= body_len]
            body = fitting[(c + r) % len(fitting)][:body_len] if fitting else (joined * (body_len // max(1, len(joined)) + 1))[:body_len]
            row = [cls_id] + body + ([sep_id] if n >= 2 else [])
            rows.append(row[:n])
        T = max(len(r) for r in rows)
        ids = np.full((len(rows), T), pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), T), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        cases.append(Case(name, ids, mask))
    return cases


def compare(
    artifact: str,
    run: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]],
    reference: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]],
    cases: Sequence[Case],
    tolerances: dict[str, Tolerance],
) -> ValidationReport:
    """Run ``run`` and ``reference`` on every case; judge each output by its stated tolerance."""
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
            err = float(np.abs(g - w).max()) if finite else float("inf")
            cos = _min_cosine(g, w) if finite else float("-inf")
            ok = finite and bool((np.abs(g - w) <= tol.atol + tol.rtol * np.abs(w)).all()) and cos >= tol.min_cosine
            s["finite"] &= finite
            s["ok"] &= ok
            if err > s["err"] or cos < s["cos"] or not finite:
                s["worst"] = case.describe()
            s["err"], s["cos"] = max(s["err"], err), min(s["cos"], cos)
    outputs = [
        OutputResult(name, s["err"], s["cos"], s["worst"] or cases[0].describe(), s["finite"], tolerances[name], s["ok"])
        for name, s in stats.items()
    ]
    return ValidationReport(artifact, outputs, [c.describe() for c in cases])


def _min_cosine(g: np.ndarray, w: np.ndarray) -> float:
    g2, w2 = g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1])
    num = (g2 * w2).sum(-1)
    den = np.linalg.norm(g2, axis=-1) * np.linalg.norm(w2, axis=-1)
    return float((num / np.maximum(den, 1e-30)).min())


def onnx_runner(path: Path, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None):
    """A function ids, mask -> {output name: array} running ``path`` in ONNX Runtime."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), opts, providers=list(providers))
    names = [o.name for o in session.get_outputs()]

    def run(ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, {"input_ids": ids, "attention_mask": mask})))

    return run


def eager_runner(graph_module: torch.nn.Module):
    """A function ids, mask -> {output name: array} running the eager graph module (FP32 reference)."""
    device = next(graph_module.parameters()).device

    @torch.no_grad()
    def run(ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        out = graph_module(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device))
        out = out if isinstance(out, tuple) else (out,)
        return {n: o.float().cpu().numpy() for n, o in zip(graph_module.output_names, out)}

    return run
