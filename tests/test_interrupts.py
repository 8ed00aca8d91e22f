"""Ctrl-C and SIGTERM during a real TensorRT-RTX build stop it: exit 130, the bundle byte-identical,
nothing left beside it. TensorRT swallows what its logger callback raises, so a KeyboardInterrupt
raised inside ``build_serialized_network`` would be lost; the signal is therefore recorded while native
code runs, the progress monitor cancels the build at its next step, and the interrupt is raised when
the builder returns.

"Inside the builder" is known, not guessed: the signal is sent when the monitor's first progress line
("TensorRT build: ...", written from TensorRT's ``phase_start`` callback) arrives, and the command must
then say the build was cancelled by the interrupt (a signal that came after the builder returned could
not). Four optimization profiles make the build take seconds (one takes 0.6 s), so the line and the
signal are never outrun by the build's end; the cancellation itself is immediate.

TensorRT-RTX builds engines without a GPU (``pip install 'mbert-export[test]'`` installs it).
"""
from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_checkpoint

pytest.importorskip("tensorrt_rtx")

MAX_SEQ = 64
PROFILES = ("--split-seq", "16,32,48")  # four profiles: a build of seconds, not 0.6 s
PROGRESS = "TensorRT build: "
CANCELLED = "TensorRT build cancelled by the interrupt"
TIMEOUT = 300


def snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def interrupted_inside_the_build(args: list, signum: int) -> tuple[int, str]:
    """Run ``mbert-export ARGS``, send ``signum`` when the build's first progress line arrives;
    (exit status, everything it wrote to standard error)."""
    proc = subprocess.Popen([sys.executable, "-m", "mbert.export.cli", *map(str, args)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stderr:  # ends when the command does: a build without the line fails below
            lines.append(line)
            if PROGRESS in line:  # the export prefixes its stage ("    engine: ")
                proc.send_signal(signum)
                break
        rest = proc.communicate(timeout=TIMEOUT)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(lines) + rest
    assert any(PROGRESS in line for line in lines), f"no progress line from inside the build:\n{err}"
    return proc.returncode, err


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory, "interrupts", seed=45)


@pytest.fixture(scope="module")
def fp16_bundle(ck, tmp_path_factory) -> Path:
    """An FP16 bundle without an engine (``--fp16 --no-engine``), for ``--engine-only``."""
    out = tmp_path_factory.mktemp("fp16") / "b"
    proc = subprocess.run([sys.executable, "-m", "mbert.export.cli", str(ck), "--out", str(out), "--fp16",
                           "--no-engine", "--max-seq-len", str(MAX_SEQ)], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_engine_only_build_stops_on_a_signal_inside_the_builder(fp16_bundle, tmp_path, signum):
    import shutil

    b = shutil.copytree(fp16_bundle, tmp_path / "b")
    before = snapshot(b)
    code, err = interrupted_inside_the_build(["--engine-only", b, "--engine", "tensorrt-rtx", *PROFILES], signum)
    assert code == 130, err
    assert CANCELLED in err and "interrupted: no bundle was written or changed" in err, err
    assert "built model.plan" not in err and "[2/2] write" not in err
    assert snapshot(b) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no staging folder, marker or lock left


def test_the_engine_stage_of_an_fp16_export_stops_on_sigterm(ck, tmp_path):
    out = tmp_path / "b"
    code, err = interrupted_inside_the_build([ck, "--out", out, "--fp16", "--engine", "tensorrt-rtx",
                                              "--max-seq-len", MAX_SEQ, *PROFILES], signal.SIGTERM)
    assert code == 130, err
    assert CANCELLED in err and "interrupted: no bundle was written or changed" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
