"""The export owns what it creates and nothing else, and publishing a bundle is atomic for readers.

* Clean-up touches only folders its marker says this tool made, and whose process is gone.
* ``--overwrite`` replaces only a folder that holds nothing but its sealed bundle (the checkpoint a
  user keeps inside a bundle folder is refused, named, and kept).
* Readers opening and encoding in a loop while bundles are published over the same path never fail
  and never see a mix; a reader that holds a bundle keeps it whole while it is replaced.
* ``--overwrite`` does not silently drop artifacts it does not rebuild; ``--out .`` works from inside
  the bundle.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import RUNTIME_TEXTS, error_line, snapshot, tiny_bundle, tiny_checkpoint, write_json
from helpers import export_cli as cli

from mbert.bundle import open_bundle, owner
from mbert.export.transaction import clean_leftovers, stage_copy, transaction
from mbert.runtime import Encoder


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory, "publish", seed=43)


@pytest.fixture(scope="module")
def exported(ck, tmp_path_factory) -> Path:
    return tiny_bundle(ck, tmp_path_factory, "exported")


# 1. clean-up removed or moved any folder named like its own -----------------------------------------

def test_clean_up_touches_only_marked_folders_of_gone_processes(tmp_path):
    pid = dead_pid()
    users = {f".b.partial-{pid}": "a user's work in progress", f".b.old-{pid}": "a user's backup"}
    for name, text in users.items():  # named like the tool's folders, but not marked: never touched
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text(text)
    dead = tmp_path / f".c.partial-{pid}"  # marked by a process that is gone: removed
    owner.claim(dead, "partial")
    dead.mkdir()
    write_json(owner.marker_of(dead), {**json.loads(owner.marker_of(dead).read_text()), "pid": pid})
    (dead / "model.onnx").write_bytes(b"half a graph")
    alive = tmp_path / f".d.partial-{os.getpid()}"  # marked by a process that runs (this one): kept
    owner.claim(alive, "partial")
    alive.mkdir()
    before = {name: snapshot(tmp_path / name) for name in users}

    removed = clean_leftovers(tmp_path)

    assert removed == [dead] and not dead.exists() and not owner.marker_of(dead).exists()
    assert {name: snapshot(tmp_path / name) for name in users} == before
    assert not (tmp_path / "b").exists()  # the unmarked ".b.old" was not "restored" either
    assert alive.is_dir()


# 2. --overwrite deleted the checkpoint stored inside the bundle it replaced ----------------------------

def test_overwrite_refuses_a_bundle_folder_that_holds_its_own_input(ck, exported, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(exported, b)
    shutil.copytree(ck, b / "ck")
    before = snapshot(b)
    proc = cli(b / "ck", "--out", b, "--overwrite", "--max-seq-len", "64")
    assert proc.returncode == 1
    line = error_line(proc)
    assert "--overwrite replaces only a folder that holds a bundle of mbert-export and nothing else" in line
    assert f"{b / 'ck'}/" in line and "is not a file of the bundle" in line
    assert snapshot(b) == before and "[1/4] load" not in proc.stderr


def test_overwrite_refuses_a_bundle_with_a_file_it_does_not_list(ck, exported, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(exported, b)
    (b / "my-notes.md").write_text("keep me")
    proc = cli(ck, "--out", b, "--overwrite", "--max-seq-len", "64")
    assert proc.returncode == 1 and f"{b / 'my-notes.md'} is not a file of the bundle" in error_line(proc)
    assert (b / "my-notes.md").read_text() == "keep me"


# 8. a reader failed while a new bundle was published over the one it opened ----------------------------

def _publish(src: Path, live: Path) -> None:
    """Publish a copy of the bundle ``src`` at ``live`` exactly as ``mbert-export --overwrite`` publishes its
    staging folder (the same transaction; the export's own work is not what readers race)."""
    with transaction(live, overwrite=True) as staging:
        stage_copy(src, staging)


def test_a_reader_keeps_the_bundle_it_opened_while_another_is_published(bundles, tmp_path):
    live = tmp_path / "live"
    _publish(bundles.bundle("mean"), live)
    reader = open_bundle(live)
    _publish(bundles.bundle("cls"), live)  # replaced while the reader holds it
    assert open_bundle(live).manifest.manifest_sha256 != reader.manifest.manifest_sha256
    for rel, entry in reader.manifest.files.items():  # the reader still reads its own bundle, whole
        assert hashlib.sha256(reader.path_of(rel).read_bytes()).hexdigest() == entry.sha256, rel
    left = [p.name for p in tmp_path.iterdir() if p.name != "live"]
    assert len(left) == 2 and any(n.startswith(".live.old-") for n in left)  # kept, marked, for its reader
    reader.close()
    _publish(bundles.bundle("mean"), live)  # the next publication removes it, now nobody reads it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live"]


def _wait_for(condition, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the readers made no progress"
        time.sleep(0.01)


def test_readers_never_fail_while_bundles_are_published(bundles, tmp_path):
    """Two reader threads open (verifying every file) and encode in a loop while a bundle is published
    over their path 10 times, two readings at least between publications: no open fails, and every
    result is one bundle's own."""
    sources = {name: bundles.bundle(name) for name in ("mean", "cls")}
    want = {}
    for name, folder in sources.items():
        with open_bundle(folder) as b:
            want[b.manifest.manifest_sha256] = Encoder.from_bundle(folder, backend="onnxruntime").encode(RUNTIME_TEXTS)
    live = tmp_path / "live"
    _publish(sources["mean"], live)
    stop, failures, opens = threading.Event(), [], []

    def read_loop() -> None:
        while not stop.is_set():
            try:
                enc = Encoder.from_bundle(live, backend="onnxruntime", threads=1)
                got = enc.encode(RUNTIME_TEXTS)
                seal = enc.bundle.manifest.manifest_sha256
                assert seal in want and np.abs(got - want[seal]).max() < 1e-5, "a mix of two bundles"
                opens.append(seal)
                enc.bundle.close()
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                failures.append(f"{type(exc).__name__}: {exc}")

    readers = [threading.Thread(target=read_loop) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for i in range(10):
            _publish(sources["cls" if i % 2 == 0 else "mean"], live)
            _wait_for(lambda: len(opens) + len(failures) >= 2 * (i + 1))  # reads between publications
    finally:
        stop.set()
        for r in readers:
            r.join(120)
    assert not failures, failures[:3]
    assert len(opens) >= 20 and len(set(opens)) == 2  # both bundles were read, whole
    clean_leftovers(tmp_path)  # what readers held during the last publications
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live"]


# 10. --int8 --overwrite silently dropped the FP16 graph and the engine ------------------------------

def test_overwrite_never_drops_what_it_does_not_rebuild(bundles, tmp_path):
    b = bundles.copy("mean-fp16", tmp_path / "b")
    before = snapshot(b)
    proc = cli(bundles.checkpoint("mean"), "--out", b, "--overwrite", "--int8", "--max-seq-len", "128")
    assert proc.returncode == 1
    line = error_line(proc)
    assert "--overwrite rebuilds the whole bundle and would drop model.fp16.onnx (add --fp16)" in line
    assert snapshot(b) == before and "[1/" not in proc.stderr


# 9. --out . inside a bundle failed with "Device or resource busy" after the whole export ---------------

def test_out_dot_from_inside_the_bundle(ck, exported, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(exported, b)
    old = open_bundle(b).manifest.created
    # the console script, as a user runs it (``python -m`` would put the bundle's triton/ folder on sys.path)
    exe = Path(sys.executable).parent / "mbert-export"
    proc = subprocess.run([str(exe), str(ck), "--out", ".", "--overwrite", "--max-seq-len", "64"], cwd=b,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert open_bundle(b).manifest.name == "b" and sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert open_bundle(b).manifest.created >= old
