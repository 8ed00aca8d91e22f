"""The private folder a serve command runs Triton in (``$TMPDIR/mbert-serve-PID-XXXX``): marked as this
tool's (:mod:`mbert.bundle.owner`), removed when the command ends, and removed by the next serve
command when the one that made it was killed (``kill -9``), with the shared-memory segments its
server left (``/dev/shm/mbertPID_*``)."""
from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from mbert.bundle import owner
from mbert.runtime.serve.server import SHM_PREFIX, remove_shm

PREFIX = "mbert-serve-"


def clean_abandoned(parent: Path) -> list[Path]:
    """Remove the serve folders in ``parent`` whose command is gone; returns them."""
    removed = []
    for path in sorted(parent.glob(f"{PREFIX}*")):
        found = owner.owner_of(path)
        if found is None or not owner.abandoned(path, "serve"):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            owner.release(path)
            remove_shm(f"{SHM_PREFIX}{found.pid}_")
            removed.append(path)
    return removed


@contextlib.contextmanager
def serve_folder(parent: Path | None = None) -> Iterator[Path]:
    """A new marked serve folder in ``parent`` (default: the temporary folder), removed on exit."""
    import os

    parent = Path(parent or tempfile.gettempdir())
    clean_abandoned(parent)
    folder = parent / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    owner.claim(folder, "serve")
    try:
        folder.mkdir(mode=0o700)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            owner.release(folder)
