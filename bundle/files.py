"""A bundle's files: confinement, hashes, and the check that they are the files the manifest sealed.

Every path the manifest names goes through :func:`mbert.modeling.paths.inside`: a relative name
whose real location, symlinks resolved, is inside its folder. Nothing outside a bundle is opened while it is verified.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from mbert.modeling.errors import BundleError
from mbert.modeling.paths import RelPath, inside


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def walk(folder: Path, skip: Iterable[str] = ()) -> list[RelPath]:
    """Every regular file under ``folder`` as sorted relative paths, ``skip`` left out; a symlink
    anywhere in the tree is refused (a bundle holds only its own files)."""
    skip = set(skip)
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            if path.is_symlink():
                raise BundleError(f"{path}: bundles hold no symbolic links")
        for name in filenames:
            rel = Path(dirpath, name).relative_to(folder).as_posix()
            if rel not in skip:
                out.append(RelPath(rel))
    return sorted(out)


def mismatches(folder: Path, table: dict[RelPath, "object"], skip: Iterable[str] = ()) -> list[str]:
    """What differs between ``folder`` and a files table {path: entry with sha256 and bytes}: missing,
    changed and unlisted files, each named."""
    problems = []
    for rel, entry in sorted(table.items()):
        path = inside(folder, rel, f"files[{rel!r}]")
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != entry.bytes or sha256(path) != entry.sha256:
            problems.append(f"{rel} differs from the file the manifest recorded (sha256 mismatch)")
    present = set(walk(folder, skip))
    problems += [f"{rel} is not listed in the manifest" for rel in sorted(present - set(table))]
    return problems
