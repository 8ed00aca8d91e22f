"""The corpus job (``mbert-run embed BUNDLE --input CORPUS --output DIR/``): Parquet shards equal to
``Encoder.encode`` in input order with their ids, resumed after kill -9 / Ctrl-C at chosen points without
a duplicate or a gap, refused on another bundle / input / options, and one line per bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import RUNTIME_TEXTS, cosines, edit_manifest, torch_blocker

from mbert.runtime.cli import main

REPO = Path(__file__).resolve().parents[1]
N = 230  # rows: 23 shards of 10, the last one short


def corpus_texts(n: int = N) -> list[str]:
    """Short and long texts (some past the bundle's 128 tokens), each distinct."""
    return [f"{i}: {RUNTIME_TEXTS[i % len(RUNTIME_TEXTS)]}" for i in range(n)]


def read_dir(folder: Path):
    """The folder's shards in name order, as one table (the record and temporary files skipped)."""
    files = sorted(folder.glob("part-*.parquet"))
    assert files, f"no shards in {folder}"
    return pa.concat_tables([pq.read_table(f) for f in files])


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mbert.runtime.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=240, env=env)


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles.bundle("mean")


@pytest.fixture(scope="module")
def encoder(bundle):
    from mbert.runtime import Encoder

    return Encoder.from_bundle(bundle, backend="onnxruntime", device="cpu")


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """A JSONL corpus with integer ids that are not the row index, and blank lines between some rows."""
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    lines = []
    for i, t in enumerate(corpus_texts()):
        lines.append(json.dumps({"id": 1000 + 7 * i, "text": t}))
        if i % 50 == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(bundle, jsonl, tmp_path_factory):
    """The uninterrupted run's folder (window 10), in a child Python that cannot import torch."""
    out = tmp_path_factory.mktemp("ref") / "out"
    env = torch_blocker(tmp_path_factory.mktemp("blocker"))
    done = run_cli("embed", bundle, "--input", jsonl, "--output", f"{out}/", "--window", 10, "--backend",
                   "onnxruntime", "--device", "cpu", env=env)
    assert done.returncode == 0, done.stderr
    return out


def test_equals_encoder_in_order_with_ids(reference, encoder):
    table = read_dir(reference)
    texts = corpus_texts()
    assert table.column("id").to_pylist() == [1000 + 7 * i for i in range(N)]
    assert table.schema.field("id").type == pa.int64()
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), encoder.dimension)
    got = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    want = encoder.encode(texts)
    cos = cosines(got, want)
    assert cos.min() >= 0.999999, cos.min()
    assert cosines(got[1:], want[:-1]).min() < 0.999  # a shift by one row would fail the comparison above
    lengths = [len(e.ids) for e in encoder.text.encode(texts)]
    assert table.column("num_tokens").to_pylist() == lengths
    cut = table.column("truncated").to_pylist()
    assert cut == [bool(e.overflowing) for e in encoder.text.encode(texts)]
    assert 0 < sum(cut) < N  # both kinds present, so the flags are compared on both
    record = json.loads((reference / "_progress.json").read_text())
    assert (record["shards"], record["rows"], record["complete"]) == (23, N, True)
    assert pq.read_table(sorted(reference.glob("part-*.parquet"))[0]).num_rows == 10  # a window a shard


def test_txt_and_parquet_inputs(bundle, encoder, tmp_path):
    """.txt: ids are line indices (blank lines skipped, counted); .parquet: string ids kept as strings."""
    texts = corpus_texts(25)
    txt = tmp_path / "c.txt"
    txt.write_text("\n".join(t.replace("\n", " ") + ("\n" if i % 4 == 0 else "") for i, t in enumerate(texts)) + "\n",
                   encoding="utf-8")
    lines = txt.read_text(encoding="utf-8").split("\n")
    want_ids = [i for i, line in enumerate(lines) if line.strip()]
    assert len(want_ids) == 25 and want_ids != list(range(25))
    result = CliRunner().invoke(main, ["embed", str(bundle), "--input", str(txt), "--output", f"{tmp_path}/t/",
                                       "--window", "4", "--backend", "onnxruntime"])
    assert result.exit_code == 0, result.output
    table = read_dir(tmp_path / "t")
    assert table.column("id").to_pylist() == want_ids
    got = np.array(table.column("embedding").to_pylist())
    assert cosines(got, encoder.encode([t.replace("\n", " ") for t in texts])).min() >= 0.999999

    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"key": [f"doc-{i}" for i in range(25)], "body": texts}), parquet, row_group_size=7)
    result = CliRunner().invoke(main, ["embed", str(bundle), "--input", str(parquet), "--output", f"{tmp_path}/p/",
                                       "--window", "5", "--text-column", "body", "--id-column", "key"])
    assert result.exit_code == 0, result.output
    table = read_dir(tmp_path / "p")
    assert table.schema.field("id").type == pa.string()
    assert table.column("id").to_pylist() == [f"doc-{i}" for i in range(25)]
    assert cosines(np.array(table.column("embedding").to_pylist()), encoder.encode(texts)).min() >= 0.999999


# --- kill -9, Ctrl-C and resume -------------------------------------------------------------------

# The job runs in a child Python whose shard writer stops the process at one chosen point: a real
# SIGKILL / SIGINT of the real job, at a place no timing decides.
STOPPER = """
import os, signal, sys
from pathlib import Path
import pyarrow.parquet
from mbert.runtime.corpus import shards
POINT, K, OUT = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
real_write, real_record, real_table = shards.write_shard, shards.write_record, pyarrow.parquet.write_table

def write_shard(folder, index, data):
    path = real_write(folder, index, data)
    if POINT == "shard-renamed" and index == K:  # shard K is in place, the record does not count it yet
        os.kill(os.getpid(), signal.SIGKILL)
    return path

def write_table(data, where, **kw):
    record = shards.read_record(OUT)
    if POINT == "mid-write" and record is not None and record.shards == K:
        where.write(b"PAR1 half a shard")  # part of shard K in its temporary file
        where.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_table(data, where, **kw)

def write_record(folder, record):
    real_record(folder, record)
    if POINT == "ctrl-c" and record.shards == K:
        os.kill(os.getpid(), signal.SIGINT)

shards.write_shard, shards.write_record, pyarrow.parquet.write_table = write_shard, write_record, write_table
from mbert.runtime.cli import main
sys.argv = ["mbert-run"] + sys.argv[4:]
main()
"""


@pytest.mark.parametrize("point, code", [("shard-renamed", -signal.SIGKILL), ("mid-write", -signal.SIGKILL),
                                         ("ctrl-c", 130)])
def test_resume_after_kill(point, code, bundle, jsonl, reference, tmp_path):
    out, k = tmp_path / "out", 7
    script = tmp_path / "stopper.py"
    script.write_text(STOPPER)
    args = ["embed", str(bundle), "--input", str(jsonl), "--output", f"{out}/", "--window", "10",
            "--backend", "onnxruntime", "--device", "cpu"]
    killed = subprocess.run([sys.executable, str(script), point, str(k), str(out), *args], capture_output=True,
                            text=True, timeout=240, start_new_session=True)
    assert killed.returncode == code, killed.stderr
    record = json.loads((out / "_progress.json").read_text())
    assert (record["shards"], record["rows"], record["complete"]) == (k, 10 * k, False)
    leftovers = {"shard-renamed": f"part-{k:06d}.parquet", "mid-write": f".part-{k:06d}.parquet.tmp-"}
    if point in leftovers:  # the crash left the uncounted shard / the half-written temporary file
        assert any(p.name.startswith(leftovers[point]) for p in out.iterdir())
    resumed = CliRunner().invoke(main, args)
    assert resumed.exit_code == 0, resumed.output
    assert f"resumed after {10 * k}" in resumed.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())  # no temporary left
    got, want = read_dir(out), read_dir(reference)
    assert got.column("id").to_pylist() == want.column("id").to_pylist()  # none duplicated, none missing
    assert got.equals(want)
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "already complete" in again.stderr


def test_refuses_another_bundle_input_or_options(bundle, jsonl, reference, tmp_path):
    out = tmp_path / "out"
    args = ["--output", f"{out}/", "--window", "10", "--backend", "onnxruntime"]
    assert CliRunner().invoke(main, ["embed", str(bundle), "--input", str(jsonl), *args]).exit_code == 0
    other = tmp_path / "other-bundle"
    import shutil

    shutil.copytree(bundle, other)
    edit_manifest(other, lambda m: m.update(created="2000-01-01T00:00:00Z"))
    other_input = tmp_path / "other.jsonl"
    other_input.write_text(jsonl.read_text(encoding="utf-8") + '{"id": 5000, "text": "one more"}\n', encoding="utf-8")
    cases = [([str(other), "--input", str(jsonl), *args], "made from another bundle"),
             ([str(bundle), "--input", str(other_input), *args], "made from another input"),
             ([str(bundle), "--input", str(jsonl), *args[:2], "--window", "11"], "other options: window 10 (now 11)"),
             ([str(bundle), "--input", str(jsonl), *args, "--prompt", "query: "], "other options: prompt None")]
    for argv, says in cases:
        result = CliRunner().invoke(main, ["embed", *argv])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1 and says in lines[0] and "--overwrite" in lines[0], result.stderr
    assert read_dir(out).equals(read_dir(reference))  # refusals touched nothing
    fresh = CliRunner().invoke(main, ["embed", str(bundle), "--input", str(other_input), *args, "--overwrite"])
    assert fresh.exit_code == 0, fresh.output
    assert read_dir(out).num_rows == N + 1


# --- bad input -----------------------------------------------------------------------------------

def _fails(bundle, path, out, *extra) -> str:
    result = CliRunner().invoke(main, ["embed", str(bundle), "--input", str(path), "--output", f"{out}/", *extra])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    return lines[0]


def test_bad_inputs_name_the_fault(bundle, tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('"fine"\n\n{"text": "also fine"}\n{"text": oops}\n', encoding="utf-8")
    assert f"{bad_json}:4: invalid JSON" in _fails(bundle, bad_json, tmp_path / "o1")

    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a", "b"], "key": [1, 2]}), table)
    line = _fails(bundle, table, tmp_path / "o2")
    assert "no text column 'text'" in line and "columns: body, key" in line

    utf8 = tmp_path / "bad.txt"
    utf8.write_bytes(b"good line\nsecond \xff line\n")
    assert f"{utf8}:2: not valid UTF-8 (byte 0xff at offset 17)" in _fails(bundle, utf8, tmp_path / "o3")
    assert utf8.read_bytes()[17] == 0xFF

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": "a", "id": 5}\n{"text": "b"}\n', encoding="utf-8")
    assert f"{mixed}:2: has no id, but the corpus's first row has an integer id" in _fails(bundle, mixed, tmp_path / "o4")

    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    line = _fails(bundle, utf8, blocked / "out")
    assert f"--output {blocked / 'out'}: cannot create the folder" in line

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert "holds files that are not a corpus job's (notes.txt)" in _fails(bundle, mixed, foreign)


@pytest.mark.parametrize("name, content", [("empty.txt", "\n \n"), ("empty.jsonl", ""), ("empty.parquet", None)])
def test_empty_corpus_writes_an_empty_dataset(bundle, encoder, tmp_path, name, content):
    path = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path.write_text(content)
    result = CliRunner().invoke(main, ["embed", str(bundle), "--input", str(path), "--output", f"{tmp_path}/o/"])
    assert result.exit_code == 0, result.output
    import pyarrow.dataset as ds

    table = ds.dataset(tmp_path / "o", format="parquet").to_table()  # the record is skipped by name
    assert table.num_rows == 0
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), encoder.dimension)
    assert json.loads((tmp_path / "o" / "_progress.json").read_text())["complete"] is True


def test_ray_without_ray_names_the_extra(bundle, jsonl, tmp_path):
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["ray"] = None\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = run_cli("embed", bundle, "--input", jsonl, "--output", f"{tmp_path}/o/", "--ray", "auto", env=env)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: --ray needs Ray Data: pip install 'mbert-export[ray]'"


def test_corpus_options_need_a_folder(bundle, jsonl, tmp_path):
    result = CliRunner().invoke(main, ["embed", str(bundle), "--input", str(jsonl), "--output",
                                       str(tmp_path / "v.npy"), "--window", "5"])
    assert result.exit_code == 2 and "only for a corpus job" in result.stderr


def test_benchmark_quick(bundle, tmp_path):
    """benchmarks/corpus.py --quick runs end to end on this module's tiny bundle and writes its table."""
    out = tmp_path / "corpus_quick.md"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "corpus.py"), "--quick", "--out", str(out),
                           "--bundle", str(bundle)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for row in ("peak RSS", "tokens/s", "resume overhead"):
        assert row in text, text
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["rss"]["small"]["rows"] < data["rss"]["large"]["rows"]
