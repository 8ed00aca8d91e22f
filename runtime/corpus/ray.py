"""The corpus job as a Ray Data pipeline: read -> ``map_batches`` on a pool of encoder actors -> Parquet.

    import ray
    from mbert.runtime.corpus.ray import embed_dataset, read_corpus

    ray.init("auto")
    ds = read_corpus("/shared/corpus.jsonl")                   # columns id, text (ids as the local job's)
    vectors = embed_dataset(ds, "/shared/engines/gte", actors=4, threads_per_actor=4)
    vectors.write_parquet("/shared/vectors/")                  # or compose further

Every node opens the bundle itself: the bundle path, the input and the output folder must be the same
paths on every node (shared storage: NFS, a PVC mounted ReadWriteMany, or a bucket FUSE mount), and
every node needs ``mbert-export[ray]`` plus a backend extra (``[cpu]``, ``[gpu]``, ``[tensorrt]``).

Failures: each actor opens and verifies the bundle once; an actor whose process dies is restarted
(``max_restarts``) and its batch retried (``max_task_retries``); Ray Data emits a batch's output only
when the call returns, so a retried batch is not emitted twice. Output files are named by write task
(:func:`_shard_names`), so a retried write replaces its own file instead of
adding one; with ``preserve_order`` the names follow input order. A run that stops (the driver dies)
starts again from the beginning when rerun: resuming is the single-process job's
(:mod:`mbert.runtime.corpus.job`).
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

from mbert.bundle.errors import CorpusError, MbertError
from mbert.runtime.corpus import shards
from mbert.runtime.corpus.reader import Corpus, Position, fingerprint

MAX_RESTARTS = 3  # an actor process that dies is started again this many times ...
MAX_TASK_RETRIES = 3  # ... and a batch it was running is retried this many times (Ray's defaults: forever)


def require_ray():
    """The ``ray`` module, or one line naming the extra that installs it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise MbertError("--ray needs Ray Data: pip install 'mbert-export[ray]'") from None
    return ray


# --- read ------------------------------------------------------------------------------------------

def read_corpus(path, *, text_column: str = "text", id_column: str | None = None, rows_per_task: int = 4096,
                concurrency: int | None = None):
    """A ``ray.data.Dataset`` of the corpus at ``path`` with columns ``id`` and ``text``: the same rows,
    ids and checks as the single-process reader (:mod:`mbert.runtime.corpus.reader`). The driver
    scans a line file once for the offsets of every ``rows_per_task``-th line (Parquet: its row groups),
    so each read task starts at a known row and line index."""
    ray = require_ray()
    # Reading and writing take no CPU of the reservation: the encoder actors reserve every CPU they
    # use, and a read task waiting for a CPU the actors hold would stall the pipeline (a 2-CPU node
    # with 2 one-CPU actors ran no read task at all).
    return ray.data.read_datasource(_datasource(path, text_column, id_column, rows_per_task), num_cpus=0,
                                     concurrency=concurrency)


def _datasource(path, text_column, id_column, rows_per_task):
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class CorpusDatasource(Datasource):
        def __init__(self):
            corpus = Corpus(path, text_column, id_column)
            self.starts = corpus.line_starts(rows_per_task)
            self.id_type, self.id_kind, self.size = corpus.id_type, corpus.id_kind, corpus.size

        def estimate_inmemory_data_size(self):
            return self.size

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            bounds = list(zip(self.starts, [s.row for s in self.starts[1:]] + [None]))
            if self.size == 0:
                return []
            return [ReadTask(_reader(path, text_column, id_column, self.id_kind, self.id_type, start, stop,
                                     rows_per_task),
                             BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=(str(path),)),
                             per_task_row_limit=per_task_row_limit)
                    for start, stop in bounds]

    return CorpusDatasource()


def _reader(path, text_column, id_column, id_kind, id_type, start: Position, stop, window):
    def read():
        import pyarrow as pa

        corpus = Corpus(path, text_column, id_column)
        if corpus.id_kind != id_kind:  # the input changed under the job
            raise CorpusError(f"{path}: changed while it was read (its first row's id kind differs)")
        ids_type = pa.string() if id_type == "string" else pa.int64()
        for w in corpus.windows(window, start, stop):
            yield pa.table({"id": pa.array(w.ids, ids_type), "text": pa.array(w.texts, pa.string())})

    return read


# --- embed -----------------------------------------------------------------------------------------

class EncodeActor:
    """One encoder per actor process: opens and verifies the bundle once (``threads`` intra-op threads),
    then embeds Arrow batches of ``text_column`` (and ``id_column``) into the shard schema. Subclass it
    to add per-batch work and pass it as ``embed_dataset(..., actor_class=...)``."""

    def __init__(self, bundle, *, backend="auto", device=None, precision=None, threads=None,
                 text_column="text", id_column="id", encode: dict | None = None):
        from mbert.runtime.encoder import Encoder

        self.encoder = Encoder.from_bundle(bundle, backend=backend, device=device, precision=precision,
                                           threads=threads, verify=True)
        self.text_column, self.id_column, self.options = text_column, id_column, dict(encode or {})

    def __call__(self, batch):
        import pyarrow as pa

        texts = batch.column(self.text_column).to_pylist()
        ids = batch.column(self.id_column).combine_chunks()
        id_type = "string" if pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type) else "int64"
        vectors = self.encoder.encode(texts, show_progress=False, **self.options)
        stats = self.encoder.last_stats
        return shards.table(ids, vectors, stats.lengths, stats.truncated_indices, id_type)


def embed_dataset(ds, bundle, *, text_column: str = "text", id_column: str = "id", actors: int = 1,
                  threads_per_actor: int = 1, batch_rows: int = 4096, backend: str = "auto",
                  device: str | None = None, precision: str | None = None, num_gpus_per_actor: float = 0,
                  prompt: str | None = None, prompt_name: str | None = None, normalize: bool | None = None,
                  batch_size: int | None = None, max_batch_tokens: int | None = None, max_restarts: int = MAX_RESTARTS,
                  max_task_retries: int = MAX_TASK_RETRIES, actor_class: type = EncodeActor):
    """``ds`` (a ``ray.data.Dataset`` with a string ``text_column`` and an integer or string
    ``id_column``) embedded by a pool of ``actors`` encoder actors, each reserving
    ``threads_per_actor`` CPUs (and ``num_gpus_per_actor`` GPUs: 1 with ``backend="tensorrt"``):
    a Dataset of ``id``, ``embedding`` (fixed_size_list<float32>[D]), ``num_tokens``, ``truncated``.
    ``batch_rows`` rows go to an actor per call (Encoder.encode batches them by token budget)."""
    ray = require_ray()
    bundle = str(Path(bundle).resolve())
    encode = {"prompt": prompt, "prompt_name": prompt_name, "normalize": normalize, "batch_size": batch_size,
              "max_batch_tokens": max_batch_tokens}
    with warnings.catch_warnings():
        # Ray 2.60 names no parameter for an actor pool's restarts and retries (its default is unlimited,
        # so a batch that kills its process every time would loop forever): they go as remote args,
        # which 2.60 warns are deprecated.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*is deprecated", category=DeprecationWarning)
        return ds.map_batches(
            actor_class, batch_size=batch_rows, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=threads_per_actor,
            num_gpus=num_gpus_per_actor or None,
            fn_constructor_kwargs=dict(backend=backend, device=device, precision=precision, threads=threads_per_actor,
                                       text_column=text_column, id_column=id_column, encode=encode),
            fn_constructor_args=(bundle,), max_restarts=max_restarts, max_task_retries=max_task_retries)


def _shard_names():
    """Ray's output files named like the single-process shards: ``part-<write uuid>_<task>-<k>.parquet``
    (Ray 2.60 requires the run's uuid in the name). Deterministic per write task, so a retried write
    task replaces its own file; with ``preserve_order`` the task numbers follow input order."""
    from ray.data.datasource import FilenameProvider

    class ShardNames(FilenameProvider):
        def get_filename_for_task(self, write_uuid, task_index):
            return f"part-{write_uuid}_{task_index:06d}.parquet"

    return ShardNames()


# --- the command-line job ---------------------------------------------------------------------------

def run_ray(address: str, bundle, input_path, folder, *, actors: int, threads_per_actor: int, window: int,
            text_column: str, id_column: str | None, backend: str, device, precision, prompt, prompt_name,
            normalize, batch_size, overwrite: bool, progress: bool, num_gpus_per_actor: float = 0,
            max_batch_tokens: int | None = None):
    """``mbert-run embed --ray``: the corpus job on the Ray cluster at ``address``, written to ``folder``
    (a path every node can write) with the single-process job's shard schema and progress record."""
    from mbert.bundle import open_bundle
    from mbert.runtime.corpus.job import Summary, start_record

    ray = require_ray()
    folder, start = Path(folder).resolve(), time.perf_counter()
    corpus = Corpus(input_path, text_column, id_column)
    manifest = open_bundle(bundle, verify=False).manifest  # each actor verifies the bundle's files
    dimension = manifest.model.hidden_size * (len(manifest.pooling.modes) if manifest.pooling else 1)
    options = {"window": window, "text_column": text_column, "id_column": id_column, "prompt": prompt,
               "prompt_name": prompt_name, "normalize": normalize, "backend": backend, "precision": precision,
               "runner": "ray"}
    fresh = shards.Record(bundle={"path": str(Path(bundle).resolve()), "manifest_sha256": manifest.manifest_sha256},
                          input=fingerprint(corpus.path), options=options, id_type=corpus.id_type, dimension=dimension,
                          extra={"actors": actors, "threads_per_actor": threads_per_actor})
    record = start_record(folder, fresh, overwrite)
    if record.complete:
        return Summary(folder, record.rows, record.shards, 0, 0, 0, 0.0, record.rows, already_complete=True)
    shards.remove_from(folder, 0)  # a Ray run that stopped starts again (see the module docstring) ...
    shards.write_record(folder, fresh)  # ... and its record lets the rerun recognise the folder as its own
    ray.init(address=address, log_to_driver=True, configure_logging=False)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = progress
        vectors = embed_dataset(read_corpus(input_path, text_column=text_column, id_column=id_column,
                                            rows_per_task=window, concurrency=actors),
                                bundle, text_column="text", id_column="id", actors=actors,
                                threads_per_actor=threads_per_actor, batch_rows=window, backend=backend,
                                device=device, precision=precision, num_gpus_per_actor=num_gpus_per_actor,
                                prompt=prompt, prompt_name=prompt_name, normalize=normalize, batch_size=batch_size,
                                max_batch_tokens=max_batch_tokens)
        vectors.write_parquet(str(folder), filename_provider=_shard_names(), min_rows_per_file=window,
                             ray_remote_args={"num_cpus": 0}, concurrency=actors)
    finally:
        ray.shutdown()
    return _finish(folder, fresh, start)


def _finish(folder: Path, record: shards.Record, start: float):
    """Count what the pipeline wrote (Parquet footers only), write the complete record, and summarise."""
    import pyarrow.parquet as pq

    from mbert.runtime.corpus.job import Summary

    files = shards.shard_files(folder)
    if not files:  # an empty corpus: one empty shard, as the single-process job writes
        shards.write_shard(folder, 0, shards.empty(record.id_type, record.dimension))
        files = shards.shard_files(folder)
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    done = shards.Record(**{**record.__dict__, "shards": len(files), "rows": rows, "complete": True})
    shards.write_record(folder, done)
    return Summary(folder, rows, len(files), rows, 0, 0, time.perf_counter() - start, 0)
