"""The corpus job on a Ray cluster: ``mbert-run embed --ray`` and ``embed_dataset`` on a local cluster the
test starts in a network namespace of its own (only loopback: Ray binds to the machine's interface even
when given 127.0.0.1, and token authentication is off), bounded in time and torn down by its process
group. Output equal to the single-process job's; one actor's process killed mid-job (SIGKILL inside its
first batch) and the output still complete, without duplicates."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import RUNTIME_TEXTS, cosines
from ray_helpers import ADDRESS, ray_session

N, WINDOW = 400, 50

DRIVER = """
import os, signal, sys
import ray
from mbert.runtime.corpus.ray import EncodeActor, embed_dataset, read_corpus

BUNDLE, CORPUS, OUT, MARKER = {bundle!r}, {corpus!r}, {out!r}, {marker!r}

class DiesOnce(EncodeActor):
    # The first batch any actor receives kills that actor's process (SIGKILL, as the OOM killer would);
    # the marker file makes it exactly once, whichever actor gets it.
    def __call__(self, batch):
        try:
            fd = os.open(MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return super().__call__(batch)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

ray.init(address={address!r})
ray.data.DataContext.get_current().execution_options.preserve_order = True
ds = read_corpus(CORPUS, rows_per_task={window}, concurrency=2)
vectors = embed_dataset(ds, BUNDLE, actors=2, batch_rows={window}, backend="onnxruntime", actor_class=DiesOnce)
vectors.write_parquet(OUT, ray_remote_args={{"num_cpus": 0}})
"""


def read_dir(folder: Path):
    """Every Parquet file of ``folder`` in name order (mbert's shard names, or Ray's own)."""
    files = sorted(folder.glob("*.parquet"))
    assert files, f"no Parquet files in {folder}"
    return pa.concat_tables([pq.read_table(f) for f in files])


@pytest.fixture(scope="module")
def session(bundles, tmp_path_factory):
    """One cluster session: the command line's Ray job, then the driver whose actor dies; and the
    single-process job on the same corpus for reference."""
    from mbert.runtime import Encoder
    from mbert.runtime.corpus import embed_corpus

    bundle = bundles.bundle("mean")
    work = tmp_path_factory.mktemp("ray")
    corpus = work / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i}: {RUNTIME_TEXTS[i % len(RUNTIME_TEXTS)]}"}) + "\n"
                              for i in range(N)), encoding="utf-8")
    enc = Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu")
    embed_corpus(enc, corpus, work / "single", window=WINDOW)
    (work / "driver.py").write_text(DRIVER.format(bundle=str(bundle), corpus=str(corpus), out=str(work / "killed"),
                                                  marker=str(work / "died"), window=WINDOW,
                                                  address=ADDRESS))
    cli = [sys.executable, "-m", "mbert.runtime.cli", "embed", str(bundle), "--input", str(corpus), "--output",
           f"{work / 'cli'}/", "--ray", ADDRESS, "--actors", "2", "--window", str(WINDOW), "--backend", "onnxruntime"]
    results = ray_session(work, [("cli", cli), ("driver", [sys.executable, str(work / "driver.py")])], timeout=240)
    return dict(results=results, work=work, single=work / "single", cli=work / "cli", killed=work / "killed")


def _result(session, name: str) -> tuple[int | None, str]:
    rc, _, err = session["results"][name]
    return rc, err or session["results"]["session"]


def test_cli_ray_equals_single_process(session):
    rc, err = _result(session, "cli")
    assert rc == 0, err[-3000:]
    single, ray = read_dir(session["single"]), read_dir(session["cli"])
    assert ray.schema == single.schema
    assert ray.column("id").to_pylist() == single.column("id").to_pylist() == list(range(N))  # in input order
    a = np.array(ray.column("embedding").to_pylist())
    b = np.array(single.column("embedding").to_pylist())
    assert cosines(a, b).min() >= 0.999999
    assert ray.column("num_tokens").equals(single.column("num_tokens"))
    assert ray.column("truncated").equals(single.column("truncated"))
    record = json.loads((session["cli"] / "_progress.json").read_text())
    assert (record["rows"], record["complete"], record["options"]["runner"]) == (N, True, "ray")
    assert "embedded 400 texts" in err and f"on Ray ({ADDRESS}, 2 actors x 1 threads)" in err


def test_killed_actor_output_complete_without_duplicates(session):
    rc, err = _result(session, "driver")
    assert rc == 0, err[-3000:]
    died = session["work"] / "died"
    assert died.exists() and int(died.read_text()) > 0  # an actor process did receive SIGKILL mid-batch
    single, killed = read_dir(session["single"]), read_dir(session["killed"])
    ids = killed.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == N  # none duplicated, none missing
    order = np.argsort(ids)
    assert [ids[i] for i in order] == single.column("id").to_pylist()
    a = np.array(killed.column("embedding").to_pylist())[order]
    b = np.array(single.column("embedding").to_pylist())
    assert cosines(a, b).min() >= 0.999999
