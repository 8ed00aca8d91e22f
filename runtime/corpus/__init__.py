"""Corpus-scale embedding: stream an input file into Parquet shards, resumable (``job``), or run the
same job as a Ray Data pipeline on a cluster (``ray``).

    from mbert.runtime import Encoder
    from mbert.runtime.corpus import embed_corpus

    embed_corpus(Encoder.from_bundle("engines/gte"), "corpus.jsonl", "vectors/")   # reruns resume

    from mbert.runtime.corpus.ray import embed_dataset                            # Ray users compose it
    vectors = embed_dataset(ray.data.read_parquet("s3://docs/"), "/shared/engines/gte", actors=8)

Never imports torch (checked by import-linter); pyarrow loads when a job starts, Ray only in ``ray``.
"""
from __future__ import annotations

from mbert.bundle.lazy import lazy_exports

_EXPORTS = {
    "embed_corpus": ".job",
    "Corpus": ".reader",
    "Record": ".shards",
    "read_corpus": ".ray",
    "embed_dataset": ".ray",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
