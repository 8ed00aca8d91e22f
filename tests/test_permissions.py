"""Files get the umask's permissions, as ``open()`` creates them: a bundle exported
by one user is read by another. ``manifest.json``, ``model.plan`` and ``mbert-run embed --output``
files are temporary files renamed into place; the temporary file is created as ``open()`` creates one
(``tempfile.mkstemp`` would make it 0600 whatever the umask, and the rename would keep that).

The other user is ``nobody`` (``setpriv --reuid``, no groups, no capabilities), so the test runs as
root, as CI does. ``nobody`` must be able to start this interpreter: where it lives under a folder
others cannot enter (``/root`` is 0700 here), the test shows ``nobody`` that one path in a private
mount namespace (the folder's own mode and everything else stay as they are); the bundle itself is
read with its real modes.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import SMALL, make_checkpoint

TINY = dict(SMALL, num_hidden_layers=2, local_attention=16)
UMASK = 0o022
TIMEOUT = 300


def require_root() -> None:
    assert os.geteuid() == 0, ("this test reads a bundle as the user nobody, so it must run as root (CI does); "
                               "run it with sudo")


def closed_ancestor(path: Path) -> Path | None:
    """The outermost folder above ``path`` that others cannot enter (no o+x), or None."""
    for parent in reversed(Path(path).parents):
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return parent
    return None


def as_nobody(command: list[str], stage: Path) -> subprocess.CompletedProcess:
    """``command`` run as nobody:nogroup without groups; a folder others cannot enter above the
    interpreter is replaced, in a private mount namespace only, by a view holding just the path to it."""
    interpreter = Path(os.path.realpath(sys.prefix))
    closed = closed_ancestor(interpreter / "bin")
    script = ""
    if closed is not None:
        child = interpreter.relative_to(closed).parts[0]
        inner = closed / child
        assert closed_ancestor(inner / "x") in (None, closed), f"{inner}: others cannot enter it either"
        script = (f'mount --bind "{closed}" "{stage}" && mount -t tmpfs -o mode=755 tmpfs "{closed}" && '
                  f'mkdir "{inner}" && mount --bind "{stage / child}" "{inner}" && ')
    script += 'cd / && exec setpriv --reuid=nobody --regid=nogroup --clear-groups --inh-caps=-all "$@"'
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *command],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env, stdin=subprocess.DEVNULL)


def under_umask(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
                          preexec_fn=lambda: os.umask(UMASK))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A folder every user can enter (pytest's own are 0700), removed afterwards."""
    require_root()
    folder = Path(tempfile.mkdtemp(prefix="mbert-permissions-"))
    folder.chmod(0o755)
    (folder / "stage").mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def bundle(shared, tmp_path_factory) -> Path:
    """``mbert-export --fp16`` with a TensorRT-RTX plan, exported under umask 022."""
    ck = make_checkpoint(tmp_path_factory.mktemp("perm") / "ck", "gte-modernbert-base", seed=46,
                         layout="cls-pooling", **TINY)
    out = shared / "b"
    proc = under_umask([sys.executable, "-m", "mbert.export.cli", str(ck), "--out", str(out), "--max-seq-len", "64",
                        "--fp16", "--engine", "tensorrt-rtx"])  # TensorRT-RTX builds without a GPU (test extra)
    assert proc.returncode == 0, proc.stderr
    return out


def test_the_other_user_can_start_this_interpreter(shared):
    import pwd

    proc = as_nobody([sys.executable, "-c", "import os, mbert.runtime; print(os.getuid(), os.getgroups())"],
                     shared / "stage")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == f"{pwd.getpwnam('nobody').pw_uid} []"


def test_every_bundle_file_has_the_umask_permissions(bundle):
    files = {p.relative_to(bundle).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in bundle.rglob("*")}
    want_file, want_dir = 0o666 & ~UMASK, 0o777 & ~UMASK
    assert {"manifest.json", "model.plan", "model.onnx"} <= set(files)
    wrong = {rel: oct(mode) for rel, mode in files.items()
             if mode != (want_dir if (bundle / rel).is_dir() else want_file)}
    assert not wrong


def test_another_user_opens_verifies_and_encodes_the_bundle(bundle, shared):
    info = as_nobody([sys.executable, "-m", "mbert.runtime.cli", "info", str(bundle)], shared / "stage")
    assert info.returncode == 0, info.stderr
    code = ("import os, sys; from mbert.runtime import Encoder; assert os.getuid() != 0; "
            "v = Encoder.from_bundle(sys.argv[1], backend='onnxruntime').encode(['tea', 'It is time for tea.']); "
            "print(v.shape)")
    proc = as_nobody([sys.executable, "-c", code, str(bundle)], shared / "stage")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("(2, ")


def test_embed_output_has_the_umask_permissions_and_another_user_reads_it(bundle, shared):
    out = shared / "vectors.npy"
    proc = under_umask([sys.executable, "-m", "mbert.runtime.cli", "embed", str(bundle), "tea", "--output", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~UMASK
    read = as_nobody([sys.executable, "-c", "import sys, numpy; print(numpy.load(sys.argv[1]).shape)", str(out)],
                     shared / "stage")
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip().startswith("(1, ")
