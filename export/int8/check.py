"""The end-to-end check of an INT8 graph: the validation grid against the eager FP32 model with the
INT8 tolerances (:data:`mbert.bundle.validation.INT8_TOLERANCES`), and a retrieval check that means
something to an embedding user; the same check on the blind quantizations (every matrix INT8, as
sentence-transformers/optimum do it), which is reported and never gates.

Retrieval: the built-in texts cut into consecutive :data:`CHUNK`-token pieces, alternately passages
and queries (so each query's best matches are the text around it); every query's top-10 passages by
cosine under the graph must overlap those under FP32 by :data:`MIN_AGREEMENT` on average. The metric
is the standard top-k overlap, kept strict: on random weights neighbour lists are near-ties (the
record states the FP32 gap between neighbours 10 and 11), and the plan keeps as many matrices FP32
as it takes to pass it.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from mbert.bundle.int8 import BlindInt8Record, RetrievalRecord
from mbert.bundle.validation import ValidationReport, compare
from mbert.export.int8.graph import write_int8
from mbert.export.int8.plan import S8, S8_7BIT
from mbert.runtime.backends.onnxruntime import onnx_runner

TOP_K = 10
MIN_AGREEMENT = 0.95  # mean overlap of the top-10 neighbour sets (the target)
CHUNK = 48  # tokens per retrieval text
CHUNKS_PER_TEXT = 24  # at most, from the start of each built-in text, so no one document dominates
BLIND = (("sentence-transformers avx512_vnni", S8), ("all matrices, 7-bit weights", S8_7BIT))


# --- retrieval ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RetrievalSet:
    queries: np.ndarray  # int64 [n, CHUNK + 2], no padding
    passages: np.ndarray
    reference: tuple[np.ndarray, np.ndarray]  # FP32 unit vectors of queries and passages


def retrieval_split(tokenizer, texts: Sequence[str], cls_id: int | None, sep_id: int | None,
                    max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(queries, passages) as int64 ids [n, chunk + 2]. Each text is cut into consecutive pieces of
    CHUNK tokens (fewer where the bundle's ``max_len`` is shorter; at most CHUNKS_PER_TEXT, a short
    remainder dropped); even pieces are passages, odd ones queries."""
    queries, passages = [], []
    head, tail = [cls_id] if cls_id is not None else [], [sep_id] if sep_id is not None else []
    chunk = min(CHUNK, max_len - len(head) - len(tail))
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        for j in range(min(CHUNKS_PER_TEXT, len(ids) // chunk)):
            (passages if j % 2 == 0 else queries).append(head + ids[j * chunk:(j + 1) * chunk] + tail)
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


def retrieval_set(tokenizer, texts: Sequence[str], cls_id, sep_id, max_len: int, reference,
                  outputs: Sequence[str]) -> RetrievalSet | None:
    """The queries, passages and their FP32 vectors (computed once); None for a graph without an
    embedding (classification and masked-LM heads: their logits are checked on the grid only)."""
    if "last_hidden_state" not in outputs:
        return None
    q, p = retrieval_split(tokenizer, texts, cls_id, sep_id, max_len)
    return RetrievalSet(q, p, (embed(reference, q), embed(reference, p)))


def topk_agreement(q_ref, p_ref, q_got, p_got, k: int = TOP_K) -> np.ndarray:
    """Per query: the fraction of its FP32 top-k passages that are also in the top-k of the other."""
    def top(q, p):
        return np.argsort(-(q @ p.T), axis=1, kind="stable")[:, :k]

    want, got = top(q_ref, p_ref), top(q_got, p_got)
    return np.array([len(set(a) & set(b)) / k for a, b in zip(want, got)])


def retrieval_check(artifact: str, run, rs: RetrievalSet, min_agreement: float = MIN_AGREEMENT) -> RetrievalRecord:
    q_ref, p_ref = rs.reference
    q, p = embed(run, rs.queries), embed(run, rs.passages)
    own, mixed = topk_agreement(q_ref, p_ref, q, p), topk_agreement(q_ref, p_ref, q, p_ref)
    sims = -np.sort(-(q_ref @ p_ref.T), axis=1)
    gap = float(np.median(sims[:, TOP_K - 1] - sims[:, TOP_K]))  # near-ties make any top-k fragile
    spread = float(np.median(sims[:, 0] - sims[:, TOP_K - 1]))
    return RetrievalRecord(artifact, len(rs.queries), len(rs.passages), TOP_K, float(own.mean()), float(own.min()),
                           float(mixed.mean()), gap, spread, min_agreement, bool(own.mean() >= min_agreement))


# --- the end-to-end check ---------------------------------------------------------------------------

@dataclass(frozen=True)
class GraphCheck:
    validation: ValidationReport | None  # None when the retrieval check already failed (fail fast)
    retrieval: RetrievalRecord | None

    @property
    def passed(self) -> bool:
        return (self.validation is not None and self.validation.passed
                and (self.retrieval is None or self.retrieval.passed))

    def detail(self) -> str:
        """What missed, in one line ("" when it passed)."""
        parts = []
        if self.retrieval is not None and not self.retrieval.passed:
            r = self.retrieval
            parts.append(f"top-{r.k} neighbour agreement {r.mean_agreement:.3f} < {r.min_agreement}")
        if self.validation is not None:
            parts += [o.describe() for o in self.validation.outputs if not o.passed]
        return "; ".join(parts)


def check_graph(artifact: str, path: Path, reference, cases, tolerances, retrieval: RetrievalSet | None,
                fail_fast: bool = False, on_case=None) -> GraphCheck:
    """``path`` on ONNX Runtime: retrieval (when there is a set), then the grid (skipped with
    ``fail_fast`` when retrieval already missed); ``on_case``: ``compare``'s progress callback."""
    run = onnx_runner(path)
    ret = retrieval_check(artifact, run, retrieval) if retrieval is not None else None
    if fail_fast and ret is not None and not ret.passed:
        return GraphCheck(None, ret)
    return GraphCheck(compare(artifact, run, reference, cases, tolerances, on_case), ret)


def blind_reports(fp32_onnx: Path, reference, cases, tolerances, retrieval: RetrievalSet | None,
                  on_case=None) -> tuple[BlindInt8Record, ...]:
    """The same check on the blind quantizations: every matrix INT8, (a) as sentence-transformers'
    ``export_dynamic_quantized_onnx_model(..., "avx512_vnni")`` writes it (optimum's config:
    per-channel, full-range int8 weights) and (b) with our 7-bit weights, so the plan's gain and the
    weight format's are told apart. Reported beside ours, never gating."""
    out = []
    with tempfile.TemporaryDirectory() as d:
        for name, fmt in BLIND:
            path = Path(d) / f"blind-{fmt.name}.onnx"
            try:
                write_int8(fp32_onnx, path, None, fmt)
                c = check_graph(f"blind int8 ({name})", path, reference, cases, tolerances, retrieval,
                                on_case=on_case(name) if on_case else None)
                out.append(BlindInt8Record(name, fmt.name, c.validation, c.retrieval, None))
            except Exception as exc:  # noqa: BLE001 - the blind path failing is a finding, not an export error
                out.append(BlindInt8Record(name, fmt.name, None, None,
                                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
            path.unlink(missing_ok=True)
    return tuple(out)
