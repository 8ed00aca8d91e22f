"""The corpus job in one process: read a window, encode it, write it as the next shard, record it.

Memory holds one window (its texts, encodings and [window, D] vectors), whatever the corpus size.
Within a window :meth:`Encoder.encode` batches the texts longest first by token budget and returns the
vectors in input order, so each shard keeps input order. A rerun of the same job resumes after the last
shard the record counts (:mod:`mbert.runtime.corpus.shards`); one made from another bundle, input or
output-changing options is refused, naming what differs.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mbert.bundle.errors import CorpusError
from mbert.runtime.corpus import shards
from mbert.runtime.corpus.reader import Corpus, Position, fingerprint

DEFAULT_WINDOW = 4096  # texts in memory at once; also the rows of a shard (~12 MB of vectors at D = 768)


@dataclass
class Summary:
    """What a run did: rows and shards in the folder, what this run added, and its time."""

    folder: Path
    rows: int
    shards: int
    added_rows: int
    tokens: int
    truncated: int
    seconds: float
    resumed_at: int  # rows already done when this run started
    already_complete: bool = False  # the folder held the finished job: nothing was done


def output_options(encoder, corpus: Corpus, window: int, prompt, prompt_name, normalize) -> dict:
    """The options a shard's content depends on (shard boundaries included): a resume must match them."""
    return {"window": window, "text_column": corpus.text_column, "id_column": corpus.id_column,
            "prompt": prompt, "prompt_name": prompt_name, "normalize": normalize,
            "artifact": encoder.backend.artifact, "precision": encoder.precision}


def new_record(encoder, corpus: Corpus, options: dict) -> shards.Record:
    bundle = {"path": str(Path(encoder.path).resolve()), "manifest_sha256": encoder.manifest.manifest_sha256}
    return shards.Record(bundle=bundle, input=fingerprint(corpus.path), options=options,
                         id_type=corpus.id_type, dimension=encoder.dimension)


def start_record(folder: Path, fresh: shards.Record, overwrite: bool) -> shards.Record:
    """The record to continue from: ``fresh`` for a new folder (or ``overwrite``), the stored one when
    it describes the same job (its uncounted shards and dead writers' temporary files removed)."""
    shards.prepare_folder(folder, overwrite)
    stored = shards.read_record(folder)
    if stored is None:
        if shards.shard_files(folder):
            raise CorpusError(f"--output {folder}: holds shards but no {shards.RECORD}; --overwrite starts again")
        return fresh
    why = stored.differs(fresh)
    if why is not None:
        raise CorpusError(f"--output {folder} was made from {why}; --overwrite starts again")
    shards.remove_from(folder, stored.shards)
    return stored


def embed_corpus(encoder, input_path, folder, *, window: int = DEFAULT_WINDOW, text_column: str = "text",
                 id_column: str | None = None, prompt: str | None = None, prompt_name: str | None = None,
                 normalize: bool | None = None, batch_size: int | None = None, overwrite: bool = False,
                 progress: bool = False) -> Summary:
    """Embed the corpus at ``input_path`` with an open :class:`~mbert.runtime.encoder.Encoder` into
    Parquet shards in ``folder``, resuming a run of the same job that stopped."""
    folder = Path(folder)
    corpus = Corpus(input_path, text_column, id_column)
    options = output_options(encoder, corpus, window, prompt, prompt_name, normalize)
    record = start_record(folder, new_record(encoder, corpus, options), overwrite)
    start, resumed_at = time.perf_counter(), record.rows
    if record.complete:
        return Summary(folder, record.rows, record.shards, 0, 0, 0, 0.0, resumed_at, already_complete=True)
    meter = Meter(corpus, Position(record.next_row, record.next_offset)) if progress else None
    added = tokens = truncated = 0
    for chunk in corpus.windows(window, Position(record.next_row, record.next_offset)):
        vectors = encoder.encode(chunk.texts, normalize=normalize, batch_size=batch_size, prompt=prompt,
                                 prompt_name=prompt_name, show_progress=False)
        stats = encoder.last_stats
        data = shards.table(chunk.ids, vectors, stats.lengths, stats.truncated_indices, record.id_type)
        shards.write_shard(folder, record.shards, data)
        record = record.advanced(len(chunk.texts), chunk.end.row, chunk.end.offset)
        shards.write_record(folder, record)
        added, tokens, truncated = added + len(chunk.texts), tokens + stats.tokens, truncated + stats.truncated
        if meter is not None:
            meter.update(record.rows, added, tokens, chunk.end)
    if record.shards == 0:  # an empty corpus: one empty shard, so the folder is a dataset with a schema
        shards.write_shard(folder, 0, shards.empty(record.id_type, record.dimension))
        record = record.advanced(0, record.next_row, record.next_offset)
    record.complete = True
    shards.write_record(folder, record)
    if meter is not None:
        meter.close()
    return Summary(folder, record.rows, record.shards, added, tokens, truncated, time.perf_counter() - start, resumed_at)


class Meter:
    """Progress on stderr: rows done, texts/s and tokens/s of this run, and the time left (from the share
    of the input read: bytes for line files, rows for Parquet). A line at most every ``EVERY`` seconds;
    on a terminal it rewrites itself."""

    EVERY = 1.0

    def __init__(self, corpus: Corpus, start: Position, stream=None):
        self.corpus, self.stream = corpus, stream or sys.stderr
        self.t0, self.f0, self.last = time.perf_counter(), corpus.fraction(start), 0.0
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def update(self, rows: int, added: int, tokens: int, at: Position) -> None:
        now = time.perf_counter()
        if now - self.last < self.EVERY:
            return
        self.last, elapsed = now, max(now - self.t0, 1e-9)
        f = self.corpus.fraction(at)
        left = elapsed * (1 - f) / (f - self.f0) if f > self.f0 else float("nan")
        line = (f"embed: {rows:,} texts ({100 * f:.1f}% of the input), {added / elapsed:,.0f} texts/s, "
                f"{tokens / elapsed:,.0f} tokens/s, {_duration(left)} left")
        self.stream.write(("\r\x1b[K" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.last:
            self.stream.write("\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    if seconds != seconds:
        return "?"
    s = int(seconds + 0.5)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
