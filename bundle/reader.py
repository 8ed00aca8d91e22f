"""Opening a bundle for reading: verified, and read through the folder that was opened.

A bundle is replaced while servers may be reading it (``mbert-export --overwrite`` publishes the new
bundle in one atomic exchange of folders: :mod:`mbert.export.transaction`). A reader must then see
the old bundle or the new one, whole, and never fail. So :func:`open_bundle`:

* opens the folder once and reads every file through that open folder (Linux: ``/proc/self/fd/N``),
  so a rename or an exchange of the path half-way cannot mix two bundles;
* holds a shared lock on the manifest it read (``flock``) for as long as the :class:`Bundle` is open:
  the exporter deletes a replaced bundle only when it can take that lock exclusively, and leaves it
  (marked as its own, for the next export to remove) while a reader holds it;
* retries when the folder it opened was deleted before it got the lock, and when the path is
  briefly missing (a file system without an atomic exchange publishes with two renames).

Elsewhere than on Linux the folder is read by its path (no ``/proc/self/fd``): the lock still keeps
a replaced bundle from being deleted under a reader, but a reader racing the exchange itself can
fail once.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from mbert.bundle.check import cross_check
from mbert.bundle.config import ModernBertConfig
from mbert.bundle.errors import BundleError, MbertError
from mbert.bundle.manifest import Manifest, read
from mbert.bundle.names import MANIFEST
from mbert.bundle.paths import inside

RETRY_S = 2.0  # how long a reader waits for a bundle that is being published
_PROC_FD = Path("/proc/self/fd")


class _Handle:
    """The open folder and the shared lock on its manifest; closed by :meth:`Bundle.close` or when
    the last reference goes."""

    def __init__(self, folder_fd: int, manifest_fd: int):
        self.folder_fd, self.manifest_fd = folder_fd, manifest_fd

    @property
    def root(self) -> Path:
        return _PROC_FD / str(self.folder_fd) if _PROC_FD.is_dir() else Path()

    def close(self) -> None:
        for name in ("manifest_fd", "folder_fd"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)  # closing the manifest releases the lock

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class Bundle:
    """An opened bundle: its folder (as given), its verified manifest and its config.json. Its files
    are read through the folder that was opened (:meth:`path_of`); it keeps a replaced bundle from
    being deleted until :meth:`close` (or until it is garbage)."""

    path: Path
    manifest: Manifest
    config: ModernBertConfig
    root: Path = field(default=None, repr=False)  # where its files are read: the open folder
    handle: _Handle | None = field(default=None, repr=False, compare=False)

    def path_of(self, rel: str, key: str = "path") -> Path:
        """The confined location of a file the manifest names, in the folder that was opened."""
        return inside(self.root or self.path, rel, key)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()

    @contextlib.contextmanager
    def naming(self) -> Iterator[None]:
        """An MbertError raised in the block names the bundle's files as the caller named the bundle,
        not by the open folder they are read through (``/proc/self/fd/N``, which tells a user nothing)."""
        try:
            yield
        except MbertError as exc:
            root = str(self.root or self.path)
            if root == str(self.path) or root not in str(exc):
                raise
            raise type(exc)(str(exc).replace(root, str(self.path))) from exc

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Open ``path``: the manifest's types, paths and seal are checked, with ``verify`` every file's
    sha256 too, and its values are cross-checked against the files; BundleError naming what differs.
    The bundle is read through the folder opened here (see the module docstring)."""
    path = Path(path)
    handle = _open_locked(path)
    root = handle.root if handle.root != Path() else path
    try:
        with Bundle(path, None, None, root).naming():
            manifest = read(root, verify=verify)
            config = cross_check(root, manifest)
    except BaseException:
        handle.close()
        raise
    return Bundle(path, manifest, config, root, handle)


def _open_locked(path: Path) -> _Handle:
    """The folder at ``path`` and its manifest, opened, with the manifest locked shared; waits up to
    :data:`RETRY_S` for a bundle being published or deleted under it."""
    deadline = time.monotonic() + RETRY_S
    while True:
        handle = _try_open(path)
        if handle is not None:
            return handle
        if time.monotonic() > deadline:
            _refuse(path)
        time.sleep(0.02)


def _try_open(path: Path) -> _Handle | None:
    try:
        folder_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None if _being_published(path) else _refuse(path)
    except NotADirectoryError:
        raise BundleError(f"{path}: is not a bundle folder") from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot open the bundle folder ({exc.strerror or exc})") from None
    try:
        manifest_fd = os.open(MANIFEST, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=folder_fd)
    except OSError:
        os.close(folder_fd)
        return None if _being_published(path) else _refuse(path)
    fcntl.flock(manifest_fd, fcntl.LOCK_SH)  # waits while an export deletes this folder
    try:
        still = os.stat(MANIFEST, dir_fd=folder_fd, follow_symlinks=False).st_ino == os.fstat(manifest_fd).st_ino
    except FileNotFoundError:
        still = False
    if not still:  # deleted (or its manifest replaced) before the lock: open the path again
        os.close(manifest_fd)
        os.close(folder_fd)
        return None
    return _Handle(folder_fd, manifest_fd)


def _being_published(path: Path) -> bool:
    """Whether an export to ``path`` holds its lock now (it may be between the two renames of a
    publication, or deleting a replaced bundle)."""
    return (path.parent / f".{path.name}.lock").exists()


def _refuse(path: Path):
    """The reason ``path`` cannot be opened as a bundle (read_raw's checks say which), raised."""
    from mbert.bundle.manifest import read_raw

    read_raw(path)  # raises for a missing folder or manifest, naming it
    raise BundleError(f"{path}: the bundle changed while it was being opened; try again")
