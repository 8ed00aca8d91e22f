"""A bundle's files: confinement, hashes, the check that they are the files the manifest sealed, the
one atomic write every file of this project goes through, and the one hard-linked copy of a folder.

Every path the manifest names goes through :func:`mbert.bundle.paths.inside`: a relative name
whose real location, symlinks resolved, is inside its folder. Nothing outside a bundle is opened while it is verified.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Callable, Iterable, Iterator

from mbert.bundle.errors import BundleError, MbertError
from mbert.bundle.paths import RelPath, inside


# Limits of every read of a file a bundle or a checkpoint names (the message states the limit).
JSON_LIMIT = 16 << 20  # a manifest with every record is ~0.2 MB; config and pooling files are KB
JSON_DEPTH = 64  # a manifest nests 7 levels
TEXT_LIMIT = 256 << 20  # a text input read whole (--input, --calibration, standard input); a corpus streams
TOKENIZER_LIMIT = 256 << 20  # tokenizer.json (ModernBERT's: 3.5 MB)
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO (named pipe)", "a folder", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: str | Path, error: type[MbertError] = BundleError, what: str = "") -> os.stat_result:
    """``path``'s stat when it is a regular file (symbolic links followed); ``error`` naming it and
    what it is otherwise (missing, a FIFO, a folder, a device), without ever opening it (a FIFO
    would block the reader)."""
    label = f"{path}" + (f" ({what})" if what else "")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise error(f"{label}: is a symbolic link to a missing file ({os.readlink(path)})") from None
        raise error(f"{label}: file not found") from None
    except OSError as exc:
        raise error(f"{label}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{label}: is {kind_of(st.st_mode)}, not a regular file")
    return st


def read_bounded(path: str | Path, limit: int, error: type[MbertError] = BundleError, what: str = "") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; ``error`` naming the file
    (and what it is, or the limit) otherwise. Opened without blocking, so a FIFO put in its place
    between the check and the open is refused too."""
    label = f"{path}" + (f" ({what})" if what else "")
    size = check_regular(path, error, what).st_size
    if size > limit:  # refused by its size, unread (a 200 MB manifest took 8.4 s and 1.26 GB to refuse)
        raise error(f"{label}: {_mib(size)} MiB, larger than the {_mib(limit)} MiB this reader accepts")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise error(f"{label}: cannot read it ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{label}: is {kind_of(mode)}, not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:  # it grew after the check
        raise error(f"{label}: larger than the {_mib(limit)} MiB this reader accepts")
    return data


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f}".removesuffix(".0")


_STRINGS = re.compile(rb'"(?:\\.|[^"\\])*"')
_BRACKETS = re.compile(rb"[\[\]{}]")


def json_depth(data: bytes) -> int:
    """How deep ``data``'s arrays and objects nest (strings skipped)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub(b"", data)):
        depth += 1 if bracket in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def read_json(path: str | Path, error: type[MbertError] = BundleError, limit: int = JSON_LIMIT,
              depth: int = JSON_DEPTH):
    """Parse a JSON file: a regular file of at most ``limit`` bytes nesting at most ``depth`` levels;
    ``error`` naming the file (and the limit it broke) when it is missing, not a regular file, too
    large, too deep, not UTF-8 or malformed."""
    data = read_bounded(path, limit, error)
    deepest = json_depth(data)
    if deepest > depth:
        raise error(f"{path}: JSON nested {deepest} levels deep; this reader accepts at most {depth}")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from exc


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
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            problems.append(f"{rel} is missing")
            continue
        if not stat.S_ISREG(mode):
            problems.append(f"{rel} is {kind_of(mode)}, not the file the manifest recorded")
        elif path.stat().st_size != entry.bytes or sha256(path) != entry.sha256:
            problems.append(f"{rel} differs from the file the manifest recorded (sha256 mismatch)")
    present = set(walk(folder, skip))
    problems += [f"{rel} is not listed in the manifest" for rel in sorted(present - set(table))]
    return problems


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary name beside ``path`` for a writer that opens the file itself; when the block ends
    normally the file is flushed to disk and renamed over ``path`` (readers see the old file or the new
    one, never a part), else it is removed and ``path`` stays as it was. The file is created as
    ``open()`` creates one (0666 less the umask: other users read what this user's umask lets them;
    ``tempfile.mkstemp`` would make it 0600). An OSError names ``path``, never the temporary name."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno is None and _disk_full(path.parent):  # a short write (numpy's tofile) on a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc
        if exc.filename in (str(tmp), tmp) or exc.filename is None:
            raise type(exc)(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _disk_full(folder: Path) -> bool:
    try:
        return os.statvfs(folder).f_bavail == 0
    except OSError:
        return False


def atomic_write(path: str | Path, data: bytes | str | Callable[[object], None]) -> None:
    """Write ``path`` whole or not at all (:func:`replacing`): ``data`` is bytes, text (UTF-8), or a
    function that writes to the open binary file."""
    with replacing(path) as tmp:
        with open(tmp, "xb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data.encode("utf-8") if isinstance(data, str) else data)


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a hard link of ``src`` (no bytes copied, same inode), a copy where they are on
    different file systems. Writers replace files (new inodes), so a linked original stays as it was."""
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def link_tree(src: Path, dst: Path, copied: Iterable[str] = ()) -> None:
    """Every file under ``src`` at the same place under ``dst`` (:func:`link_or_copy`); files named in
    ``copied`` are copied, for a reader that edits them in place."""
    copied = frozenset(copied)
    for dirpath, _dirs, names in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (Path(dst) / rel).mkdir(parents=True, exist_ok=True)
        for name in names:
            if name in copied:
                shutil.copyfile(Path(dirpath, name), Path(dst) / rel / name)
            else:
                link_or_copy(Path(dirpath, name), Path(dst) / rel / name)
