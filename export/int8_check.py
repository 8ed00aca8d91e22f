"""The INT8 stage: sensitivity plan, ``model.int8.onnx``, and its validation against the eager FP32
model on the same grid as the FP32 and FP16 graphs, plus a retrieval check, beside the blind
quantization (every matrix INT8, as sentence-transformers/optimum do it), which is reported, never
gating. A miss of ours raises :class:`~mbert.modeling.errors.ValidationError`.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from mbert.modeling.errors import ValidationError

from .int8 import (GATE, PLAN_MAX_LEN, S8, S8_7BIT, Int8Plan, MatrixDecision, WeightFormat, combined_damage,
                   matrix_sites, measure, plan, plan_headers, plan_table, save_int8)
from .int8_graph import integer_matmuls, kernels_run, matrix_nodes, quantize_graph
from .validate import Tolerance, compare, onnx_runner

# INT8 graph vs FP32 eager, worst case over the grid. Dynamic INT8 rounds every activation to 1/255
# of its tensor's range, so per-token vectors carry ~1% noise; pooling averages it.
INT8_TOLERANCES = {
    # 0.995: the contract for an embedding a retrieval index can mix with FP32 ones; at this
    # cosine the top-10 neighbours of the built-in retrieval check still agree (checked below).
    "sentence_embedding": Tolerance(atol=float("inf"), rtol=0.0, min_cosine=1 - GATE["sentence_embedding"],
                                    reason="pooled INT8 vs FP32: cosine >= 0.995 (the INT8 contract)"),
    # 0.98 per token: rounding noise of ~88 INT8 products leaves tokens at ~0.99+; a token under 0.98
    # means quantization broke a region (an activation outlier flattening the rest of its tensor).
    "last_hidden_state": Tolerance(atol=float("inf"), rtol=0.0, min_cosine=1 - GATE["last_hidden_state"],
                                   reason="per-token INT8 rounding; < 0.98 means a broken region"),
    "logits": Tolerance(atol=float("inf"), rtol=0.0, min_cosine=1 - GATE["logits"],
                        reason="head logits INT8 vs FP32: cosine >= 0.995"),
}
TOP_K = 10
MIN_AGREEMENT = 0.95  # mean overlap of the top-10 neighbour sets (the target)
CHUNK = 48  # tokens per retrieval text
CHUNKS_PER_TEXT = 24  # at most, from the start of each built-in text, so no one document dominates


# --- retrieval ------------------------------------------------------------------------------------

def retrieval_split(tokenizer, texts: Sequence[str], cls_id: int, sep_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(queries, passages) as int64 ids [n, CHUNK + 2], no padding. Each built-in text is cut into
    consecutive CHUNK-token pieces (at most CHUNKS_PER_TEXT, a short remainder dropped); even pieces
    are passages, odd ones queries, so every query's best matches are the text around it."""
    queries, passages = [], []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        for j in range(min(CHUNKS_PER_TEXT, len(ids) // CHUNK)):
            row = [cls_id] + ids[j * CHUNK:(j + 1) * CHUNK] + [sep_id]
            (passages if j % 2 == 0 else queries).append(row)
    return np.array(queries, dtype=np.int64), np.array(passages, dtype=np.int64)


def embed(run, ids: np.ndarray, batch: int = 32) -> np.ndarray:
    """L2-normalised embeddings: ``sentence_embedding`` where the graph has it, else the mean of
    ``last_hidden_state`` (the rows have no padding)."""
    out = []
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch]
        got = run(x, np.ones_like(x))
        v = got["sentence_embedding"] if "sentence_embedding" in got else got["last_hidden_state"].mean(axis=1)
        out.append(np.asarray(v, dtype=np.float64))
    v = np.concatenate(out)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)


@dataclass(frozen=True)
class RetrievalResult:
    artifact: str
    queries: int
    passages: int
    k: int
    mean_agreement: float  # mean over queries of |top-k(INT8) & top-k(FP32)| / k
    worst_agreement: float
    mixed_mean_agreement: float  # INT8 queries against an FP32-built index
    fp32_gap_median: float  # median over queries of the FP32 cosine gap between neighbours k and k+1
    min_agreement: float
    passed: bool

    def to_dict(self) -> dict:
        return asdict(self)


def topk_agreement(q_ref, p_ref, q_got, p_got, k: int = TOP_K) -> np.ndarray:
    """Per query: the fraction of its FP32 top-k passages that are also in the top-k of the other."""
    def top(q, p):
        return np.argsort(-(q @ p.T), axis=1, kind="stable")[:, :k]

    want, got = top(q_ref, p_ref), top(q_got, p_got)
    return np.array([len(set(a) & set(b)) / k for a, b in zip(want, got)])


def retrieval_check(artifact: str, run, ref_vectors: tuple[np.ndarray, np.ndarray], queries, passages,
                    min_agreement: float = MIN_AGREEMENT) -> RetrievalResult:
    q_ref, p_ref = ref_vectors
    q, p = embed(run, queries), embed(run, passages)
    own, mixed = topk_agreement(q_ref, p_ref, q, p), topk_agreement(q_ref, p_ref, q, p_ref)
    sims = -np.sort(-(q_ref @ p_ref.T), axis=1)
    gap = float(np.median(sims[:, TOP_K - 1] - sims[:, TOP_K]))  # near-ties make any top-k fragile
    return RetrievalResult(artifact, len(queries), len(passages), TOP_K, float(own.mean()), float(own.min()),
                           float(mixed.mean()), gap, min_agreement, bool(own.mean() >= min_agreement))


# --- the stage -------------------------------------------------------------------------------------

@dataclass
class Int8Outcome:
    plan: Int8Plan
    validation: dict  # ours (gating) with the blind reports beside it
    summary: dict  # for the manifest
    table: list  # plan rows for printing


def plan_batches(tokenizer, texts: Sequence[str], max_len: int):
    from .precision import scan_batches

    return scan_batches(tokenizer, texts, max_len)


def build_plan(graph, batches, fp32_onnx: Path, fmt: WeightFormat = S8_7BIT, progress=None) -> Int8Plan:
    """Measure and plan the matrices the FP32 graph computes as a ``MatMul`` with a constant weight;
    the others (a classifier's 2-D ``Gemm``, a tied decoder behind a ``Transpose``) stay FP32, said so."""
    in_graph = matrix_nodes(fp32_onnx)
    t0 = time.perf_counter()
    report = measure(graph, batches, fmt, progress, sites=[s for s, _ in matrix_sites(graph.model) if s in in_graph])
    t1 = time.perf_counter()
    result = plan(report, check=lambda sites: combined_damage(graph, batches, sites, fmt))
    result.cost_s = {"solo": t1 - t0, "combined": time.perf_counter() - t1}
    for site, _ in matrix_sites(graph.model):
        if site not in in_graph:
            result.matrices.append(MatrixDecision(site.name, site.layer, site.module, {}, "float32",
                                                  "not a MatMul with a constant weight in model.onnx"))
    return result


def validate_int8(name: str, path: Path, reference, cases, tolerances, retrieval) -> tuple[dict, RetrievalResult | None]:
    run = onnx_runner(path)
    report = compare(name, run, reference, cases, tolerances)
    ret = None
    if retrieval is not None:
        queries, passages, ref_vectors = retrieval
        ret = retrieval_check(name, run, ref_vectors, queries, passages)
    d = report.to_dict()
    d["retrieval"] = ret.to_dict() if ret else None
    d["passed"] = report.passed and (ret is None or ret.passed)
    return d, ret


def run_int8(graph, tokenizer, texts, cases, reference: Callable, tmp: Path, max_len: int,
             builtin_texts: Sequence[str], stages, blind: bool = True, plan_max_len: int = PLAN_MAX_LEN) -> Int8Outcome:
    """Plan, write ``tmp/model.int8.onnx`` + ``int8.json`` + ``int8.png``, validate; raise on a miss
    (after writing int8.json, so the failure can be inspected)."""
    cfg = graph.model.config
    batches = plan_batches(tokenizer, texts, min(max_len, plan_max_len))
    plan_ = stages.run("int8 plan", build_plan, graph, batches, tmp / "model.onnx")
    graph_info = stages.run("int8 graph", quantize_graph, tmp / "model.onnx", tmp / "model.int8.onnx",
                            plan_.int8_sites(), S8_7BIT)
    probe = cases[0]
    graph_info["kernels"] = kernels_run(tmp / "model.int8.onnx", probe.input_ids, probe.attention_mask)
    tolerances = {n: INT8_TOLERANCES[n] for n in graph.output_names}
    retrieval = None
    if cfg.task == "encoder":
        queries, passages = retrieval_split(tokenizer, builtin_texts, cfg.cls_token_id, cfg.sep_token_id)
        retrieval = (queries, passages, (embed(reference, queries), embed(reference, passages)))

    def validate_all():
        ours, _ = validate_int8("model.int8.onnx", tmp / "model.int8.onnx", reference, cases, tolerances, retrieval)
        ours["blind"] = blind_reports(tmp / "model.onnx", reference, cases, tolerances, retrieval) if blind else {}
        return ours

    validation = stages.run("validate int8", validate_all)
    save_int8(tmp / "int8.json", plan_, validation, graph_info)
    from .plot import plot_int8

    plot_int8(plan_, tmp / "int8.png")
    summary = {
        "plan": "int8.json", "plot": "int8.png", "weight_format": plan_.fmt,
        "int8_matrices": len(plan_.int8_sites()), "fp32_matrices": [s.name for s in plan_.fp32_sites()],
        "integer_kernels": integer_matmuls(graph_info["kernels"]), "budget": plan_.budget,
    }
    outcome = Int8Outcome(plan_, validation, summary, plan_table(plan_))
    raise_if_failed(validation)
    return outcome


def blind_reports(fp32_onnx: Path, reference, cases, tolerances, retrieval) -> dict:
    """The same validation on the blind quantizations: every matrix INT8, (a) as sentence-transformers'
    ``export_dynamic_quantized_onnx_model(..., "avx512_vnni")`` writes it (optimum's config: per-channel,
    full-range int8 weights) and (b) with our 7-bit weights, so the plan's gain and the weight format's
    are told apart. Reported beside ours, never gating."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for key, fmt in (("sentence-transformers avx512_vnni", S8), ("all matrices, 7-bit weights", S8_7BIT)):
            path = Path(d) / f"blind-{fmt.name}.onnx"
            try:
                quantize_graph(fp32_onnx, path, None, fmt)
                out[key], _ = validate_int8(f"blind int8 ({key})", path, reference, cases, tolerances, retrieval)
            except Exception as exc:  # the blind path failing is a finding, not an export error
                out[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return out


def raise_if_failed(v: dict) -> None:
    """The gate: :class:`ValidationError` naming each output or check that missed its threshold."""
    if not v["passed"]:
        raise ValidationError(_failure(v))


def _failure(v: dict) -> str:
    parts = [f"{o['name']}: worst cosine {o['worst_cosine']:.5f} < {o['tolerance']['min_cosine']} at {o['worst_case']}"
             for o in v["outputs"] if not o["passed"]]
    r = v.get("retrieval")
    if r and not r["passed"]:
        parts.append(f"top-{r['k']} neighbour agreement {r['mean_agreement']:.3f} < {r['min_agreement']}")
    return "model.int8.onnx does not match the eager FP32 model: " + "; ".join(parts)


def print_plan(plan_: Int8Plan) -> str:
    """The plan as a text table (what ``mbert-export --int8`` prints)."""
    rows = [tuple(str(c) for c in r) for r in plan_table(plan_)]
    headers = plan_headers(plan_)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    budget = ", ".join(f"{k} {v:.1e}" for k, v in plan_.budget.items())
    combined = ", ".join(f"{k} {v:.2e}" for k, v in plan_.combined.items())
    lines.append(f"budget (1 - cosine): {budget}; measured with the chosen set: {combined or '-'} "
                 f"({plan_.checks} combined checks)")
    return "\n".join(lines)

