"""The output folder of a corpus job: Parquet shards in one schema and the progress record.

Each shard ``part-NNNNNN.parquet`` holds consecutive input rows in input order:

    id          int64 (the given integer id, or the row / line index) or string (given string ids)
    embedding   fixed_size_list<float32>[D]
    num_tokens  int32 (tokens the model saw, special tokens and any prompt included, after truncation)
    truncated   bool (the text was cut to the bundle's max length)

``_progress.json`` records what the folder was made from (the bundle's manifest seal, the input's
fingerprint, the options that change the output) and how far the job got. A shard is written whole
(``mbert.bundle.files.atomic_write``: temporary name, fsync, rename) *before* the record counts it, so
after any crash the record names only shards that are complete; a shard present but not counted is
written again. Readers (pyarrow.dataset, pandas, datasets, Ray) skip names starting with ``_`` or ``.``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from mbert.bundle.errors import CorpusError
from mbert.bundle.files import atomic_write, read_json

RECORD = "_progress.json"
SHARD = "part-{:06d}.parquet"
FORMAT = "mbert-corpus-embeddings/1"
# part-NNNNNN.parquet: the single-process job's shard N; part-<write uuid>_NNNNNN-K.parquet: file K of
# a Ray run's write task N (Ray 2.60 requires the run's uuid in the name; names sort in input order)
_SHARD = re.compile(r"part-(?:(\d{6})|[0-9a-f]{32}_\d{6}-\d+)\.parquet")
_TEMPORARY = re.compile(r"\.(part-\d{6}\.parquet|_progress\.json)\.tmp-\d+-[0-9a-f]+")


def schema(id_type: str, dimension: int):
    import pyarrow as pa

    return pa.schema([("id", pa.string() if id_type == "string" else pa.int64()),
                      ("embedding", pa.list_(pa.float32(), dimension)),
                      ("num_tokens", pa.int32()),
                      ("truncated", pa.bool_())])


def table(ids, vectors: np.ndarray, lengths, truncated_indices, id_type: str):
    """The shard table of one window: ``ids`` (a list or an Arrow array), ``vectors`` [N, D]."""
    import pyarrow as pa

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dimension = vectors.shape if vectors.ndim == 2 else (0, 0)
    flags = np.zeros(n, dtype=bool)
    flags[list(truncated_indices)] = True
    out = schema(id_type, dimension)
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dimension)
    ids = ids.cast(out.field("id").type) if isinstance(ids, (pa.Array, pa.ChunkedArray)) else pa.array(ids, out.field("id").type)
    return pa.Table.from_arrays([ids, embedding, pa.array(np.asarray(lengths, dtype=np.int32)), pa.array(flags)],
                                schema=out)


def empty(id_type: str, dimension: int):
    """The table of no rows (an empty corpus's one shard: a dataset with its schema)."""
    return table([], np.zeros((0, dimension), dtype=np.float32), [], [], id_type)


def write_shard(folder: Path, index: int, data) -> Path:
    import pyarrow.parquet as pq

    path = folder / SHARD.format(index)
    atomic_write(path, lambda handle: pq.write_table(data, handle))
    return path


def shard_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if _SHARD.fullmatch(p.name))


# --- the progress record ---------------------------------------------------------------------------

@dataclass
class Record:
    """What ``_progress.json`` holds. ``made_from`` (bundle, input, options) must match for a rerun to
    resume; ``shards``/``rows``/``next_row``/``next_offset`` say how far it got."""

    bundle: dict
    input: dict
    options: dict
    id_type: str
    dimension: int
    shards: int = 0
    rows: int = 0
    next_row: int = 0
    next_offset: int = 0
    complete: bool = False
    format: str = FORMAT
    extra: dict = field(default_factory=dict)  # informative, never compared (e.g. the Ray job's actors)

    def advanced(self, rows: int, next_row: int, next_offset: int) -> "Record":
        return replace(self, shards=self.shards + 1, rows=self.rows + rows, next_row=next_row, next_offset=next_offset)

    def differs(self, other: "Record") -> str | None:
        """What makes ``other`` another job than this record's, in words; None when it is the same."""
        if self.bundle["manifest_sha256"] != other.bundle["manifest_sha256"]:
            return (f"another bundle (manifest sha256 {self.bundle['manifest_sha256'][:12]} from {self.bundle['path']}; "
                    f"this one is {other.bundle['manifest_sha256'][:12]} from {other.bundle['path']})")
        mine, theirs = self.input, other.input
        if (mine["bytes"], mine["sample_sha256"]) != (theirs["bytes"], theirs["sample_sha256"]):
            return (f"another input ({mine['path']}, {mine['bytes']} bytes, sample sha256 {mine['sample_sha256'][:12]}; "
                    f"this one is {theirs['path']}, {theirs['bytes']} bytes, {theirs['sample_sha256'][:12]})")
        changed = [f"{k} {self.options.get(k)!r} (now {other.options.get(k)!r})"
                   for k in sorted(set(self.options) | set(other.options)) if self.options.get(k) != other.options.get(k)]
        if changed:
            return "other options: " + ", ".join(changed)
        return None


def read_record(folder: Path) -> Record | None:
    path = folder / RECORD
    if not path.exists():
        return None
    raw = read_json(path, CorpusError)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CorpusError(f"{path}: not a progress record of this version ({FORMAT}); --overwrite starts again")
    try:
        return Record(**raw)
    except TypeError as exc:
        raise CorpusError(f"{path}: malformed progress record ({exc}); --overwrite starts again") from None


def write_record(folder: Path, record: Record) -> None:
    atomic_write(folder / RECORD, json.dumps(asdict(record), indent=2) + "\n")


# --- the folder ------------------------------------------------------------------------------------

def prepare_folder(folder: Path, overwrite: bool) -> None:
    """Create ``folder`` (and its parents) and check it can be written; refuse one holding files that are
    not this job's (a non-hidden name other than shards and the record). ``overwrite`` removes the
    job's own files."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CorpusError(f"--output {folder}: cannot create the folder ({exc.strerror or exc})") from None
    if not folder.is_dir():
        raise CorpusError(f"--output {folder}: exists and is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CorpusError(f"--output {folder}: the folder is not writable")
    foreign = sorted(p.name for p in folder.iterdir()
                     if not (_SHARD.fullmatch(p.name) or p.name == RECORD or p.name.startswith(".")))
    if foreign:
        raise CorpusError(f"--output {folder}: holds files that are not a corpus job's ({', '.join(foreign[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder")
    if overwrite:
        remove_from(folder, 0)
        (folder / RECORD).unlink(missing_ok=True)


def remove_from(folder: Path, first: int) -> None:
    """Remove shards ``first`` and later (and every file of a Ray run), and the temporary files writers
    killed mid-write left."""
    for p in folder.iterdir():
        m = _SHARD.fullmatch(p.name)
        if (m and (m.group(1) is None or int(m.group(1)) >= first)) or _TEMPORARY.fullmatch(p.name):
            p.unlink(missing_ok=True)
