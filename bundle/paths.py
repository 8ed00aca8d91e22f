"""Confinement: a path read from a file (a bundle manifest, a checkpoint's modules.json) is a
relative name that stays inside its folder, or it is refused, naming the key and the value."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mbert.bundle.errors import BundleError, MbertError


class RelPath(str):
    """A relative, confined path inside a bundle or checkpoint folder (POSIX separators)."""


def check_relpath(value: Any, key: str, error: type[MbertError] = BundleError) -> RelPath:
    """``value`` as a :class:`RelPath`: no absolute path, no ``..``, no empty or ``.`` component, no
    backslash or NUL; ``error`` naming ``key`` and the value otherwise."""
    if not isinstance(value, str):
        raise error(f"{key}: expected a relative path (a string), got {type(value).__name__} {value!r:.60}")
    parts = value.split("/")
    problem = None
    if not value:
        problem = "is empty"
    elif "\\" in value or "\x00" in value:
        problem = "contains a backslash or NUL"
    elif value.startswith("/") or (len(value) > 1 and value[1] == ":"):
        problem = "is absolute"
    elif ".." in parts:
        problem = "leads out of its folder ('..')"
    elif any(p in ("", ".") for p in parts):
        problem = "has an empty or '.' component"
    if problem:
        raise error(f"{key}: path {value!r} {problem}; only relative names inside the folder are allowed")
    return RelPath(value)


def inside(folder: str | Path, rel: Any, key: str, error: type[MbertError] = BundleError) -> Path:
    """``folder / rel`` after checking that ``rel`` is a confined relative name and that no symlink
    on the way leads out of ``folder``; ``error`` naming ``key`` and the value otherwise."""
    rel = check_relpath(rel, key, error)
    root = Path(os.path.realpath(folder))
    target = Path(os.path.realpath(root / rel))
    if target != root and root not in target.parents:
        raise error(f"{key}: path {rel!r} resolves outside {folder} (a symbolic link leads out of the folder)")
    return Path(folder) / rel  # through ``folder`` as given: an open bundle folder is read through its fd
