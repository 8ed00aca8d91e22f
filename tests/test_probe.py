"""Hostile input: every read of a file a bundle or a checkpoint names is typed (regular files only, named as what they are otherwise) and bounded
(size and JSON nesting, with the limit in the message), verification on or off; every such input is
exit 1 with one line, never a hang, never exit 3. A full disk names the file being written.

Driven through ``mbert-export`` and ``mbert-run`` as a user would, each in a subprocess with a
timeout (a hang fails the test instead of stopping the suite).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import tiny_bundle, tiny_checkpoint

TIMEOUT = 120  # seconds; far above the few each command takes, so only a hang reaches it


def export(*args, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "-m", "mbert.export.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def run(*args, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "-m", "mbert.runtime.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def python(code: str, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def error_line(proc, code: int = 1) -> str:
    """The one error line of a failed command (exit ``code``: 1 bad input), no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "Error:", "internal error:"))]
    assert proc.returncode == code and len(lines) == 1 and "Traceback" not in proc.stderr, \
        (proc.returncode, proc.stderr[-3000:])
    return lines[0]


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory, "probe", seed=44)


@pytest.fixture(scope="module")
def bundle(ck, tmp_path_factory) -> Path:
    return tiny_bundle(ck, tmp_path_factory, "probe-bundle")


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


# 5. info --no-verify and from_bundle(verify=False) blocked forever on a FIFO ----------------------------

def test_info_without_verification_names_a_fifo_config(bundle, tmp_path):
    b = shutil.copytree(bundle, tmp_path / "b")
    replace_with_fifo(b / "config.json")
    line = error_line(run("info", b, "--no-verify"))
    assert "config.json" in line and "is a FIFO (named pipe), not a regular file" in line


@pytest.mark.parametrize("name", ["config.json", "model.onnx"])
def test_encoder_without_verification_names_a_fifo(bundle, tmp_path, name):
    b = shutil.copytree(bundle, tmp_path / "b")
    replace_with_fifo(b / name)
    proc = python(f"""
        from mbert.bundle.errors import MbertError
        from mbert.runtime import Encoder
        try:
            Encoder.from_bundle({str(b)!r}, backend="onnxruntime", verify=False)
        except MbertError as exc:
            print("refused:", exc)
        """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("refused:") and f"{b / name}" in proc.stdout
    assert "is a FIFO (named pipe), not a regular file" in proc.stdout


# 6. exit 3 (RecursionError, MemoryError) and unbounded reads on bad input ---------------------------------

def test_a_deeply_nested_manifest_is_refused_with_the_limit(bundle, tmp_path):
    from mbert.bundle.files import JSON_DEPTH

    b = shutil.copytree(bundle, tmp_path / "b")
    (b / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    line = error_line(run("info", b))
    assert f"{b / 'manifest.json'}: JSON nested 100000 levels deep; this reader accepts at most {JSON_DEPTH}" in line


def test_a_huge_manifest_is_refused_by_its_size_unread(bundle, tmp_path):
    """A sparse 200 MiB manifest: the message states its whole size, which only its stat knows (a
    bounded read stops at the limit)."""
    from mbert.bundle.files import JSON_LIMIT

    b = shutil.copytree(bundle, tmp_path / "b")
    with open(b / "manifest.json", "r+b") as f:
        f.truncate(200 << 20)
    line = error_line(run("info", b, "--no-verify"))
    assert f"{b / 'manifest.json'}: 200 MiB, larger than the {JSON_LIMIT >> 20} MiB this reader accepts" in line


def test_input_from_a_device_is_refused_unread(bundle):
    line = error_line(run("embed", bundle, "--input", "/dev/zero"))
    assert "/dev/zero" in line and "is a character device, not a regular file" in line


def test_an_input_file_over_the_limit_is_refused_by_its_size(bundle, tmp_path):
    from mbert.bundle.files import TEXT_LIMIT

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(TEXT_LIMIT + (1 << 20))
    line = error_line(run("embed", bundle, "--input", big))
    assert f"{big} (text file): {(TEXT_LIMIT >> 20) + 1} MiB, larger than the {TEXT_LIMIT >> 20} MiB" in line


def test_calibration_from_a_device_is_refused(ck, tmp_path):
    proc = export(ck, "--out", tmp_path / "b", "--max-seq-len", "64", "--int8", "--calibration", "/dev/zero")
    line = error_line(proc)
    assert "/dev/zero" in line and "is a character device, not a regular file" in line
    assert not (tmp_path / "b").exists()


# 7. a dangling or FIFO modules.json lost the pooling silently (exit 0) -----------------------------------

@pytest.mark.parametrize("kind", ["dangling symlink", "fifo"])
def test_an_unreadable_modules_json_is_an_error_naming_it(ck, tmp_path, kind):
    c = shutil.copytree(ck, tmp_path / "ck")
    modules = c / "modules.json"
    modules.unlink()
    if kind == "fifo":
        os.mkfifo(modules)
        what = "is a FIFO (named pipe), not a regular file"
    else:
        modules.symlink_to(c / "gone.json")
        what = f"is a symbolic link to a missing file ({c / 'gone.json'})"
    line = error_line(export(c, "--out", tmp_path / "b", "--max-seq-len", "64"))
    assert f"{modules}" in line and what in line
    assert not (tmp_path / "b").exists()


# 9. messages that named the wrong cause --------------------------------------------------------------

def test_a_folder_in_place_of_a_bundle_file_is_named_as_a_folder(bundle, tmp_path):
    b = shutil.copytree(bundle, tmp_path / "b")
    (b / "tokenizer.json").unlink()
    (b / "tokenizer.json").mkdir()
    line = error_line(run("info", b))
    assert "tokenizer.json is a folder, not the file the manifest recorded" in line and "missing" not in line


def test_a_fifo_in_place_of_a_checkpoint_file_is_named_as_a_fifo(ck, tmp_path):
    c = shutil.copytree(ck, tmp_path / "ck")
    replace_with_fifo(c / "tokenizer.json")
    line = error_line(export(c, "--out", tmp_path / "b", "--max-seq-len", "64"))
    assert f"{c / 'tokenizer.json'}" in line and "is a FIFO (named pipe), not a regular file" in line
    assert "missing" not in line and "not found" not in line


def _in_small_tmpfs(size: str, command: list[str], mount: Path) -> subprocess.CompletedProcess:
    """``command`` run in a private mount namespace where ``mount`` is a tmpfs of ``size`` (root only);
    its standard output ends with a line "left: NAMES" (what the tmpfs holds when it has exited)."""
    script = (f'mount -t tmpfs -o size={size} tmpfs "$1" || exit 9; d="$1"; shift; "$@"; rc=$?; '
              'echo "left: $(ls -A "$d" | tr "\\n" " ")"; exit $rc')
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(mount),
                           *map(str, command)], capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("size", ["64k", "1m"])
def test_a_full_disk_names_the_file_being_written(ck, tmp_path, size):
    """The bundle's folder on a tmpfs too small for it: the line names a file of the bundle being
    written (never the checkpoint's) and says the disk is full; nothing is left."""
    assert os.geteuid() == 0, "this test mounts a small tmpfs: run it as root (CI does)"
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = _in_small_tmpfs(size, [sys.executable, "-m", "mbert.export.cli", ck, "--out", disk / "b",
                                  "--max-seq-len", "64"], disk)
    line = error_line(proc)
    assert "No space left on device" in line and f"{disk / 'b'}" in line, line
    assert f"{ck}" not in line and ".partial-" not in line
    assert proc.stdout.splitlines()[-1].strip() == "left:"


def test_an_output_error_names_the_output_not_its_temporary_file(bundle, tmp_path):
    """``mbert-run embed --output`` onto a full disk: the line names the output file, not the
    temporary file it is written to before the rename, and leaves neither."""
    assert os.geteuid() == 0, "this test mounts a small tmpfs: run it as root (CI does)"
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"text number {i}\n" for i in range(400)))  # 400 x 128 float32: 200 kB
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = _in_small_tmpfs("16k", [sys.executable, "-m", "mbert.runtime.cli", "embed", bundle, "--input", texts,
                                   "--output", disk / "vectors.npy"], disk)
    line = error_line(proc)
    assert line == f"error: {disk / 'vectors.npy'}: No space left on device", line
    assert proc.stdout.splitlines()[-1].strip() == "left:"


# 10. progress bars were drawn when the output was not a terminal -------------------------------------

def test_embed_draws_no_progress_bar_when_stderr_is_not_a_terminal(bundle, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"text number {i}\n" for i in range(50)))
    plain = run("embed", bundle, "--input", texts, "--output", tmp_path / "v.npy")
    assert plain.returncode == 0, plain.stderr
    forced = run("embed", bundle, "--input", texts, "--output", tmp_path / "w.npy", "--progress")
    bar = "text/s]"  # tqdm's rate, on every redraw of the bar
    assert forced.returncode == 0 and bar in forced.stderr  # the bar, when asked for (so the check can fail)
    assert bar not in plain.stderr and "encode:" not in plain.stderr
