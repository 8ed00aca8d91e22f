"""The INT8 records of a bundle: the sensitivity plan of ``model.int8.onnx``, the end-to-end checks
that chose its matrices, its retrieval check, and the blind quantizations reported beside it.

The graph itself is a :class:`~mbert.bundle.manifest.GraphRecord` of precision ``"int8"`` (its
``validation`` is the grid report of the chosen graph); :class:`Int8Record` is the manifest's ``int8``
field. ``int8.json`` (``plan``) holds the same record plus what only a reader of the details needs
(the quantized nodes, the kernels ONNX Runtime ran).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mbert.bundle.paths import RelPath
from mbert.bundle.validation import ValidationReport


@dataclass(frozen=True)
class MatrixPlan:
    """One weight matrix of the plan: how far quantizing it alone moved each output (1 - cosine, worst
    calibration row; None where the output was not finite) and where it runs, with the reason."""

    site: str  # "layers.3.mlp.Wi"; a head matrix by its module name ("head.dense")
    layer: int | None
    module: str  # "attn.Wqkv", "attn.Wo", "mlp.Wi", "mlp.Wo", or the head's module
    damage: dict[str, float | None]  # empty where the matrix could not be measured (see why)
    precision: Literal["int8", "fp32"]
    why: str  # "" when INT8


@dataclass(frozen=True)
class RetrievalRecord:
    """Top-k neighbours of queries among passages (chunks of the built-in texts) under the graph vs
    under the eager FP32 model: the mean overlap of the two top-k sets must reach ``min_agreement``."""

    artifact: str
    queries: int
    passages: int
    k: int
    mean_agreement: float  # mean over queries of |top-k(graph) & top-k(FP32)| / k
    worst_agreement: float  # the worst query's overlap
    mixed_mean_agreement: float  # the graph's queries against an index built with FP32 passages
    fp32_gap_median: float  # median over queries of the FP32 cosine gap between neighbours k and k+1
    fp32_score_spread_median: float  # median over queries of FP32 cosine(1st) - cosine(k-th)
    min_agreement: float
    passed: bool


@dataclass(frozen=True)
class Int8Check:
    """One end-to-end check of a candidate INT8 set in ONNX Runtime (grid and retrieval)."""

    int8_matrices: int  # the cheapest-first prefix of the candidates that was quantized
    passed: bool
    detail: str  # what missed, or "passed"


@dataclass(frozen=True)
class BlindInt8Record:
    """A blind quantization (every matrix INT8) on the same grid and retrieval check; reference only."""

    name: str
    weight_format: str
    validation: ValidationReport | None
    retrieval: RetrievalRecord | None
    error: str | None  # why it could not be built or run


@dataclass(frozen=True)
class Int8Record:
    plan: RelPath  # int8.json
    plot: RelPath  # int8.png
    weight_format: str  # "s8-7bit": per-channel symmetric int8 weights in +-64
    budget: dict[str, float]  # 1 - cosine per output a matrix may cost alone, and the chosen set together
    calibration: str  # the rows the sensitivity was measured on
    matrices: tuple[MatrixPlan, ...]
    combined_damage: dict[str, float | None]  # the chosen set together, emulated on the calibration rows
    checks: tuple[Int8Check, ...]  # in the order made; the passing one of the chosen size is the graph's validation
    retrieval: RetrievalRecord | None  # None for heads without an embedding (classification, masked LM)
    integer_kernels: int  # integer matrix products ONNX Runtime's profiler saw run
    blind: tuple[BlindInt8Record, ...]
    seconds: dict[str, float]  # what the plan cost, per step

    def int8_sites(self) -> tuple[str, ...]:
        return tuple(m.site for m in self.matrices if m.precision == "int8")

    def fp32_sites(self) -> tuple[str, ...]:
        return tuple(m.site for m in self.matrices if m.precision == "fp32")


# --- presentation (shared by mbert-export's summary and mbert-run info) ---------------------------

def describe_retrieval(r: RetrievalRecord, fp32_gaps: bool = True) -> str:
    verdict = "pass" if r.passed else "FAIL"
    text = (f"top-{r.k} neighbour agreement {r.mean_agreement:.3f} (worst query {r.worst_agreement:.1f}; its "
            f"queries against an FP32 index {r.mixed_mean_agreement:.3f}) over {r.queries} queries x {r.passages} "
            f"passages, {verdict} (>= {r.min_agreement})")
    if fp32_gaps:
        text += (f"; FP32 cosine gap between neighbours {r.k} and {r.k + 1}: median {r.fp32_gap_median:.4f} "
                 f"(1st to {r.k}th: {r.fp32_score_spread_median:.4f})")
    return text


def plan_table(record: Int8Record) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(headers, rows): per matrix its layer, damage alone per output, where it runs and why."""
    outputs = tuple(record.budget)

    def cell(m: MatrixPlan, o: str) -> str:
        if o not in m.damage:
            return "-"
        return "not finite" if m.damage[o] is None else f"{m.damage[o]:.2e}"

    headers = ("layer", "matrix", *(f"alone 1-cos {o}" for o in outputs), "runs in", "why")
    rows = [("-" if m.layer is None else str(m.layer), m.module, *(cell(m, o) for o in outputs),
             m.precision.upper(), m.why) for m in record.matrices]
    return headers, rows


def summary_lines(record: Int8Record) -> list[str]:
    """The plan in a few lines: what runs INT8, the budget, the checks that chose it, the retrieval."""
    n, total = len(record.int8_sites()), len(record.matrices)
    fp32 = [m for m in record.matrices if m.precision == "fp32"]

    def pairs(d: dict) -> str:
        return ", ".join(f"{k} {'not finite' if v is None else format(v, '.2e')}" for k, v in d.items())

    lines = [f"INT8 plan ({record.weight_format} per-channel weights, dynamic per-tensor activations): {n} of "
             f"{total} matrices INT8; details in {record.plan}, {record.plot}",
             f"  measured on {record.calibration}",
             f"  budget (1 - cosine, alone and together): {pairs(record.budget)}; chosen set together (emulated): "
             f"{pairs(record.combined_damage)}",
             "  end-to-end checks in ONNX Runtime (grid + retrieval): "
             + "; ".join(f"{c.int8_matrices} INT8 -> {c.detail}" for c in record.checks)]
    if fp32:
        lines.append(f"  FP32 ({len(fp32)}): " + "; ".join(f"{m.site} ({m.why})" for m in fp32[:8])
                     + (f"; ... {len(fp32) - 8} more" if len(fp32) > 8 else ""))
    if record.retrieval is not None:
        lines.append("  retrieval: " + describe_retrieval(record.retrieval))
    for b in record.blind:
        if b.retrieval is not None:
            lines.append(f"  blind ({b.name}, reference only): " + describe_retrieval(b.retrieval, False))
        elif b.error:
            lines.append(f"  blind ({b.name}, reference only): could not run: {b.error}")
    lines.append("  cost: " + ", ".join(f"{k} {v:.0f}s" for k, v in record.seconds.items()))
    return lines
