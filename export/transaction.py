"""Writing a bundle as a transaction: it appears complete or not at all, faults lose nothing, and the
export touches nothing that is not its own.

* :func:`check_target` decides, before any work starts, whether ``out`` may be written: a new path,
  an empty folder, or (with ``overwrite``) a folder that holds exactly a sealed bundle of this tool
  and nothing else; anything else is refused, naming the file at fault. :func:`check_source` refuses
  an input that lies inside the folder the export would replace.
* :func:`transaction` holds an exclusive lock on the target (``.NAME.lock`` beside it, removed when
  released) for the whole export, so a second export to the same ``--out`` stops at once; writes into
  a hidden staging folder ``.NAME.partial-PID`` beside the target; on success publishes it
  (:func:`publish`); on any error or interrupt removes the staging folder and leaves the target as it
  was.
* Publishing is atomic for readers too: an existing bundle is exchanged with the new one in one
  ``renameat2(RENAME_EXCHANGE)``, so the path always names a whole bundle, and readers, which read
  through the folder they opened and hold a shared lock on its manifest (:mod:`mbert.bundle.reader`),
  keep reading the old one. The old one is deleted once no reader holds it; while one does, it stays
  as ``.NAME.old-PID`` for the next export to remove. (File systems without the exchange get two
  renames; readers wait out the instant between them.)
* Every staging and replaced folder carries a marker beside it (:mod:`mbert.bundle.owner`: this tool,
  the pid, the process's start time). The next export to the same parent folder removes the folders
  of processes that are gone (``kill -9``, a power cut), and only those; a folder named like them but
  without a valid marker is never touched.

SIGTERM is turned into the same interrupt as Ctrl-C by the command line (:func:`sigterm_as_interrupt`).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Callable, Iterator

from mbert.bundle import owner
from mbert.bundle.errors import BundleError
from mbert.bundle.files import JSON_LIMIT, link_tree, read_json, walk
from mbert.bundle.manifest import KNOWN_FORMATS
from mbert.bundle.names import MANIFEST

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)(-\d+)?$")


def resolved(out: Path) -> Path:
    """``out`` as an absolute path (``--out .`` names the folder itself, not ``.``, which cannot be
    renamed), its last component's symbolic link not followed."""
    out = Path(os.path.abspath(out))
    return out.parent.resolve() / out.name


def check_target(out: Path, overwrite: bool) -> None:
    """BundleError when exporting to ``out`` would destroy anything that is not a bundle of this tool,
    or would replace a bundle without ``overwrite``."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise BundleError(f"{out}: exists and is not a folder; refusing to replace it")
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise BundleError(f"{out}: already exists; pass --overwrite to replace it")
    why = _not_only_a_bundle(out)
    if why:
        raise BundleError(f"{out}: --overwrite replaces only a folder that holds a bundle of mbert-export and "
                          f"nothing else, and this one does not ({why}); choose another --out or move it yourself")


def _not_only_a_bundle(folder: Path) -> str:
    """Why ``folder`` is not exactly a sealed bundle of this tool (a file its manifest does not list, a
    missing or foreign manifest), or "" when it is."""
    path = folder / MANIFEST
    if not path.is_file() or path.is_symlink():
        return f"it has no {MANIFEST}"
    try:
        raw = read_json(path, BundleError, JSON_LIMIT)
    except BundleError as exc:
        return str(exc)
    if not isinstance(raw, dict) or raw.get("format_version") not in KNOWN_FORMATS:
        return f"{MANIFEST} has no known mbert-export format_version"
    listed = raw.get("files")
    if not isinstance(listed, dict):
        return f"{MANIFEST} has no files table"
    try:
        present = walk(folder, skip=[MANIFEST])
    except BundleError as exc:
        return str(exc)
    extra = [rel for rel in present if rel not in listed]
    if extra:
        return f"{folder / extra[0]} is not a file of the bundle" + (f" ({len(extra) - 1} more)" if len(extra) > 1 else "")
    empty = [d for d, subdirs, files in os.walk(folder) if not subdirs and not files]
    if empty:
        return f"{empty[0]} is a folder the bundle does not have"
    return ""


def check_source(source: Path, out: Path) -> None:
    """An export never reads its input from inside the folder it replaces: BundleError otherwise."""
    source, out = Path(os.path.realpath(source)), Path(os.path.realpath(out))
    if source == out or out in source.parents:
        raise BundleError(f"{source}: the checkpoint lies inside {out}, the folder this export would replace; "
                          "move it out first, or choose another --out")


@contextlib.contextmanager
def lock(out: Path) -> Iterator[None]:
    """Hold the exclusive export lock of ``out``; BundleError at once when another process holds it."""
    out = Path(out)
    path = out.parent / f".{out.name}.lock"
    handle = _acquire(path)
    if handle is None:
        raise BundleError(f"{out}: another export to this folder is running ({_holder(path)}); wait for it to "
                          "finish or choose another --out")
    try:
        handle.truncate(0)
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        yield
    finally:
        _release(path, handle)


def _acquire(path: Path):
    """An open handle holding ``flock`` on the file ``path`` names now, or None when another process
    holds it. A lock file is removed when released, so after locking, the handle must still be the file
    at ``path`` (not one a releaser just unlinked); else it tries again."""
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        try:
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                return handle
        except FileNotFoundError:
            pass
        handle.close()


def _release(path: Path, handle) -> None:
    path.unlink(missing_ok=True)  # while still holding the lock: nobody can be inside it
    handle.close()


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "another process"
    except OSError:
        return "another process"


def clean_leftovers(parent: Path, report: Callable[[str], None] = lambda m: None, held: str | None = None) -> list[Path]:
    """Remove the staging and replaced folders of dead exports in ``parent``; returns what was removed.

    A folder is touched only when its marker says this tool made it and the process that made it is
    gone (or, for a replaced bundle, is this process), and only while no export holds its target's lock
    (``held`` names the target whose lock this process holds). A replaced bundle still open in a
    reader stays; one whose target is missing (an export died between the two renames of a
    publication) is moved back into place."""
    removed = []
    if not parent.is_dir():
        return removed
    for path in sorted(parent.iterdir()):
        m = _LEFTOVER.match(path.name)
        if not m or not (owner.abandoned(path, m["kind"]) or (m["kind"] == "old" and _mine(path))):
            continue
        lock_path = parent / f".{m['name']}.lock"
        handle = None if m["name"] == held else _acquire(lock_path)
        if handle is None and m["name"] != held:
            continue  # an export to that target is running: its folders are in use
        try:
            target = parent / m["name"]
            if m["kind"] == "old" and not os.path.lexists(target):
                os.replace(path, target)
                owner.release(path)
                report(f"restored {target} from {path.name} (an earlier export died while publishing it)")
            elif _remove_unread(path):
                removed.append(path)
                report(f"removed {path} (left by an export that did not finish)")
        finally:
            if handle is not None:
                _release(lock_path, handle)
    return removed


def _mine(folder: Path) -> bool:
    found = owner.owner_of(folder)
    return found is not None and found == owner.Owner.me(found.kind)


def _remove_unread(folder: Path) -> bool:
    """Delete ``folder`` and its marker unless a reader holds its manifest (:mod:`mbert.bundle.reader`);
    True when it was deleted."""
    try:
        fd = os.open(folder / MANIFEST, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        fd = None  # no manifest (a staging folder): nobody reads it
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():
            return False
        owner.release(folder)
        return True
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def transaction(out: Path, overwrite: bool, report: Callable[[str], None] = lambda m: None) -> Iterator[Path]:
    """Yield an empty staging folder; when the block ends normally it replaces ``out``."""
    out = resolved(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with lock(out):
        check_target(out, overwrite)  # again, under the lock
        clean_leftovers(out.parent, report, held=out.name)
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        if owner.owner_of(tmp) is not None:  # this pid's own, from a process that reused it
            _remove_unread(tmp)
        if os.path.lexists(tmp):
            raise BundleError(f"{tmp}: is in the way of this export's staging folder and not marked as "
                              "mbert-export's own; move it away")
        owner.claim(tmp, "partial")
        tmp.mkdir()
        try:
            yield tmp
            if not (tmp / MANIFEST).is_file():
                raise BundleError(f"{out}: internal error, the bundle has no manifest")
            publish(tmp, out, report)
        except OSError as exc:  # name the bundle file being written, not its staging path
            if isinstance(exc.filename, str) and exc.filename.startswith(str(tmp)):
                raise type(exc)(exc.errno, exc.strerror or str(exc), str(out) + exc.filename[len(str(tmp)):]) from exc
            raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            if not tmp.exists():
                owner.release(tmp)


def publish(new: Path, out: Path, report: Callable[[str], None] = lambda m: None) -> None:
    """Make ``new`` (a marked staging folder beside ``out``) the bundle at ``out`` in one step for readers
    (see the module docstring); the replaced bundle is deleted, or left marked while a reader holds it."""
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    if exchange(new, out):
        displaced = new  # the old bundle now lies at the staging name
    else:  # no atomic exchange on this file system: two renames, which readers wait out
        displaced = _free_name(out.parent / f".{out.name}.old-{os.getpid()}")
        owner.claim(displaced, "old")
        os.replace(out, displaced)
        os.replace(new, out)
        owner.release(new)
    old = _free_name(out.parent / f".{out.name}.old-{os.getpid()}")
    if displaced != old:
        owner.claim(old, "old")
        os.replace(displaced, old)
        owner.release(displaced)
    if not _remove_unread(old):
        report(f"the replaced bundle is still open in another process; it stays as {old} until the next export "
               "to this folder removes it")


def _free_name(old: Path) -> Path:
    """``old``, or ``old-N``: a replaced bundle of this process may still be held by a reader there."""
    if os.path.lexists(old) and _mine(old):
        _remove_unread(old)
    n = 1
    candidate = old
    while os.path.lexists(candidate) or os.path.lexists(owner.marker_of(candidate)):
        candidate, n = old.with_name(f"{old.name}-{n}"), n + 1
    return candidate


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the folders at ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False when
    this system or file system cannot (the caller renames instead)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def stage_copy(bundle: Path, tmp: Path) -> None:
    """Fill ``tmp`` with hard links (copies across file systems) of every file of ``bundle``. Later
    writes to ``tmp`` replace files (new inodes), so the linked originals stay byte-identical."""
    link_tree(bundle, tmp)


class Interrupted(KeyboardInterrupt):
    """SIGTERM, delivered as an interrupt so that every cleanup runs as for Ctrl-C."""


_signalled: list[int] = []


def sigterm_as_interrupt() -> None:
    """Make SIGTERM and Ctrl-C raise :class:`Interrupted` / KeyboardInterrupt in the main thread (call
    from a command line), and remember that they came (:func:`was_interrupted`)."""
    def handler(signum, frame):
        _signalled.append(signum)
        raise Interrupted(f"signal {signum}")

    def on_int(signum, frame):
        _signalled.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, on_int)


def was_interrupted() -> bool:
    """True once SIGTERM or Ctrl-C arrived: a library that caught the interrupt and raised its own
    error instead (exporters wrap what goes wrong while they trace; TensorRT swallows an exception
    raised in its callbacks) must still end as an interrupt."""
    return bool(_signalled)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[Callable[[], bool]]:
    """Ctrl-C and SIGTERM recorded, not raised, while the block runs native code that calls back into
    Python (a TensorRT build: TensorRT swallows an exception raised in its callbacks, so the interrupt
    would be lost and the build would go on). The block polls the yielded function to cancel its work
    (TensorRT's progress monitor returns False); on leaving it, a recorded signal is delivered to the
    handlers that were in place (Ctrl-C and SIGTERM end as interrupts). Outside the main thread,
    signals cannot be handled there, and the block runs as it is."""
    arrived: list[int] = []

    def record(signum, frame):
        arrived.append(signum)
        _signalled.append(signum)

    try:
        previous = {s: signal.signal(s, record) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        yield lambda: bool(_signalled)
        return
    try:
        yield lambda: bool(arrived)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if arrived:
            handler = previous[arrived[0]]
            if callable(handler):
                handler(arrived[0], None)  # ours raise Interrupted / KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), arrived[0])


__all__ = ["check_target", "check_source", "transaction", "publish", "exchange", "clean_leftovers", "stage_copy",
           "sigterm_as_interrupt", "was_interrupted", "deferred_interrupts", "Interrupted"]
