"""A corpus read as a stream of windows: ``.txt`` (one text a line), ``.jsonl`` (a JSON string, or an
object with a text key and an optional id key, a line) or ``.parquet`` (a text column and an optional id
column); any other name reads as ``.txt``.

Rows and ids:
* ``.txt`` and ``.jsonl``: blank lines separate nothing and are skipped; a row's default id is its
  line index (0-based: line number - 1), so an id always names its line, blank lines or not.
* ``.parquet``: every row is a text (an empty string is embedded, a null is refused); the default id
  is the row index.
* A given id (the ``id`` key / column, or ``--id-column``) is an integer (kept as int64) or a string
  (kept as a string column); one corpus holds one kind, set by its first row.

Reading resumes at a :class:`Position` (the next row, and for line files its byte offset, so a resumed
job seeks instead of re-reading). Memory holds one window of texts, and one line of at most
``LINE_LIMIT`` bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mbert.bundle.errors import TextFileError
from mbert.bundle.files import check_regular

LINE_LIMIT = 64 << 20  # one line of a .txt / .jsonl corpus (the encoder keeps ~12 characters per token)
SAMPLE_BLOCKS, SAMPLE_BYTES = 17, 64 << 10  # the input's fingerprint: 17 evenly spaced 64 KiB blocks
INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class Position:
    """Where reading goes on: the next row index (line index for line files) and its byte offset."""

    row: int = 0
    offset: int = 0


@dataclass
class Window:
    """Up to ``window`` rows: their ids and texts, and the position after the last of them."""

    ids: list
    texts: list[str]
    end: Position


def kind_of_input(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet", ".pq": "parquet"}.get(suffix, "text")


def fingerprint(path: Path) -> dict:
    """The input's size and the sha256 of ``SAMPLE_BLOCKS`` evenly spaced blocks (first and last
    included): an appended, truncated or rewritten corpus differs; reading it all would cost a pass."""
    st = check_regular(path, TextFileError, "corpus")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        span = max(0, st.st_size - SAMPLE_BYTES)
        for k in range(SAMPLE_BLOCKS):
            f.seek(span * k // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BYTES))
    return {"path": str(path.resolve()), "bytes": st.st_size, "sample_sha256": h.hexdigest()}


class Corpus:
    """One input file, read in windows. ``id_kind`` is ``"index"``, ``"int"`` or ``"str"`` (from the
    first row, :meth:`probe`); every later row must agree."""

    def __init__(self, path: str | os.PathLike, text_column: str = "text", id_column: str | None = None):
        self.path = Path(path)
        self.kind = kind_of_input(self.path)
        self.text_column = text_column
        self.id_column = id_column  # None: "id" where present
        self.size = check_regular(self.path, TextFileError, "corpus").st_size
        self._parquet = _Parquet(self) if self.kind == "parquet" else None
        self.id_kind = self.probe()

    # --- the id kind -------------------------------------------------------------------------
    def probe(self) -> str:
        if self.kind == "parquet":
            return self._parquet.id_kind
        if self.kind == "text":
            return "index"
        with open(self.path, "rb") as f:
            offset = 0
            for row, raw in enumerate(iter(lambda: f.readline(LINE_LIMIT + 1), b"")):
                line = _decode(self.path, raw, row, offset).rstrip("\r\n")
                offset += len(raw)
                if line.strip():
                    _, given = _json_row(self.path, row + 1, line, self.text_column, self.id_column)
                    return _check_id(self.path, row + 1, given, None)
        return "index"

    @property
    def id_type(self) -> str:
        """The Arrow type of the id column: ``"string"`` for string ids, else ``"int64"``."""
        return "string" if self.id_kind == "str" else "int64"

    # --- reading -----------------------------------------------------------------------------
    def windows(self, window: int, start: Position = Position(), stop: int | None = None) -> Iterator[Window]:
        """Windows of up to ``window`` rows from ``start`` up to row ``stop`` (excluded; None: the end)."""
        if self.kind == "parquet":
            yield from self._parquet.windows(window, start, stop)
        else:
            yield from _lines(self, start, stop, window, self.id_kind)

    def fraction(self, position: Position) -> float:
        """How far ``position`` is into the corpus (bytes for line files, rows for Parquet)."""
        if self.kind == "parquet":
            total = self._parquet.rows
            return position.row / total if total else 1.0
        return position.offset / self.size if self.size else 1.0

    def line_starts(self, every: int) -> list[Position]:
        """Positions of every ``every``-th line from the start (line files), or of every row group
        boundary near it (Parquet): where independent readers of one corpus start."""
        if self.kind == "parquet":
            return self._parquet.group_starts(every)
        starts, row, offset = [Position()], 0, 0
        with open(self.path, "rb") as f:
            while chunk := f.read(16 << 20):
                at = 0
                while (nl := chunk.find(b"\n", at)) >= 0:
                    row += 1
                    at = nl + 1
                    if row % every == 0:
                        starts.append(Position(row, offset + at))
                offset += len(chunk)
        if starts[-1].offset >= self.size and len(starts) > 1:
            starts.pop()
        return starts


# --- line files ------------------------------------------------------------------------------------

def _lines(corpus: Corpus, start: Position, stop: int | None, window: int, id_kind: str | None) -> Iterator[Window]:
    path, jsonl = corpus.path, corpus.kind == "jsonl"
    row, offset = start.row, start.offset
    ids: list = []
    texts: list[str] = []
    with open(path, "rb") as f:
        f.seek(offset)
        while stop is None or row < stop:
            raw = f.readline(LINE_LIMIT + 1)
            if not raw:
                break
            if len(raw) > LINE_LIMIT and not raw.endswith(b"\n"):
                raise TextFileError(f"{path}:{row + 1}: line longer than the {LINE_LIMIT >> 20} MiB this reader accepts")
            line = _decode(path, raw, row, offset)
            offset += len(raw)
            row += 1
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            if jsonl:
                text, given = _json_row(path, row, line, corpus.text_column, corpus.id_column)
                id_kind = _check_id(path, row, given, id_kind)
            else:
                text, given = line, None
            ids.append(row - 1 if given is None else given)
            texts.append(text)
            if len(texts) == window:
                yield Window(ids, texts, Position(row, offset))
                ids, texts = [], []
    if texts:
        yield Window(ids, texts, Position(row, offset))


def _decode(path: Path, raw: bytes, row: int, offset: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = offset + exc.start
        raise TextFileError(f"{path}:{row + 1}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {at})") from None
    return text[1:] if offset == 0 and text.startswith("\ufeff") else text


def _json_row(path: Path, number: int, line: str, text_key: str, id_key: str | None) -> tuple[str, object]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TextFileError(f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if isinstance(value, str):
        if id_key is not None:
            raise TextFileError(f'{path}:{number}: a JSON string has no "{id_key}" key (--id-column {id_key})')
        return value, None
    if not isinstance(value, dict):
        raise TextFileError(f'{path}:{number}: expected a JSON string or an object with a "{text_key}" key, '
                            f"got {type(value).__name__}")
    if text_key not in value:
        keys = ", ".join(sorted(value)) or "none"
        raise TextFileError(f'{path}:{number}: JSON object has no "{text_key}" key (keys: {keys})')
    text = value[text_key]
    if not isinstance(text, str):
        raise TextFileError(f'{path}:{number}: "{text_key}" must be a string, got {type(text).__name__}')
    key = id_key or "id"
    if key not in value:
        if id_key is not None:
            raise TextFileError(f'{path}:{number}: JSON object has no "{id_key}" key (--id-column {id_key})')
        return text, None
    return text, _valid_id(path, number, value[key], key)


def _valid_id(path: Path, number: int, value, key: str):
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)
                                  and INT64[0] <= value <= INT64[1]):
        return value
    raise TextFileError(f'{path}:{number}: "{key}" must be a string or a 64-bit integer, got {value!r:.40}')


def _check_id(path: Path, number: int, given, id_kind: str | None) -> str:
    kind = "index" if given is None else ("str" if isinstance(given, str) else "int")
    if id_kind is not None and kind != id_kind:
        said = {"index": "no id", "int": "an integer id", "str": "a string id"}
        raise TextFileError(f"{path}:{number}: has {said[kind]}, but the corpus's first row has {said[id_kind]} "
                            "(one corpus holds one kind of id)")
    return kind


# --- Parquet ---------------------------------------------------------------------------------------

class _Parquet:
    """The text and id columns of a Parquet file, read a row group at a time."""

    def __init__(self, corpus: Corpus):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.corpus, path = corpus, corpus.path
        try:
            self.file = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            raise TextFileError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())})") from None
        schema = self.file.schema_arrow
        names = schema.names
        if corpus.text_column not in names:
            raise TextFileError(f"{path}: no text column {corpus.text_column!r} (columns: {', '.join(names) or 'none'}; "
                                "choose one with --text-column)")
        text_type = schema.field(corpus.text_column).type
        if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
            raise TextFileError(f"{path}: column {corpus.text_column!r} holds {text_type}, not strings")
        self.id_name = corpus.id_column or ("id" if "id" in names else None)
        if corpus.id_column is not None and corpus.id_column not in names:
            raise TextFileError(f"{path}: no id column {corpus.id_column!r} (columns: {', '.join(names)})")
        self.id_kind = "index"
        if self.id_name is not None:
            id_type = schema.field(self.id_name).type
            if pa.types.is_integer(id_type):
                self.id_kind = "int"
            elif pa.types.is_string(id_type) or pa.types.is_large_string(id_type):
                self.id_kind = "str"
            else:
                raise TextFileError(f"{path}: id column {self.id_name!r} holds {id_type}, not integers or strings")
        meta = self.file.metadata
        self.group_rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self.rows = sum(self.group_rows)

    def group_starts(self, every: int) -> list[Position]:
        starts, row, last = [Position()], 0, 0
        for n in self.group_rows[:-1]:
            row += n
            if row - last >= every:
                starts.append(Position(row))
                last = row
        return starts

    def windows(self, window: int, start: Position, stop: int | None) -> Iterator[Window]:
        stop = self.rows if stop is None else min(stop, self.rows)
        group, first = 0, 0
        while group < len(self.group_rows) and first + self.group_rows[group] <= start.row:
            first += self.group_rows[group]
            group += 1
        if start.row >= stop:
            return
        columns = [self.corpus.text_column] + ([self.id_name] if self.id_name else [])
        row, done = first, start.row  # done: the row after the last one taken
        batches = self.file.iter_batches(batch_size=window, row_groups=range(group, len(self.group_rows)),
                                         columns=columns)
        ids: list = []
        texts: list = []
        for batch in batches:
            lo, hi = max(start.row - row, 0), min(stop - row, batch.num_rows)
            if lo < hi:
                part = batch.slice(lo, hi - lo)
                texts += self._texts(part, row + lo)
                ids += self._ids(part, row + lo)
            row += batch.num_rows
            while len(texts) >= window:
                done += window
                yield Window(ids[:window], texts[:window], Position(done))
                ids, texts = ids[window:], texts[window:]
            if row >= stop:
                break
        if texts:
            yield Window(ids, texts, Position(stop))

    def _texts(self, part, first: int) -> list[str]:
        column = part.column(self.corpus.text_column)
        if column.null_count:
            bad = first + column.is_null().to_pylist().index(True)
            raise TextFileError(f"{self.corpus.path}: row {bad}: column {self.corpus.text_column!r} is null")
        return column.to_pylist()

    def _ids(self, part, first: int) -> list:
        if self.id_name is None:
            return list(range(first, first + part.num_rows))
        column = part.column(self.id_name)
        if column.null_count:
            bad = first + column.is_null().to_pylist().index(True)
            raise TextFileError(f"{self.corpus.path}: row {bad}: id column {self.id_name!r} is null")
        return column.to_pylist()
