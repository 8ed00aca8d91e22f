"""Writing a bundle as a transaction: it appears complete or not at all, and faults lose nothing.

* :func:`check_target` decides, before any work starts, whether ``out`` may be written: a new path,
  an empty folder, or (with ``overwrite``) a folder that is a bundle of this tool; anything else is
  refused, naming it.
* :func:`transaction` holds an exclusive lock on the target (``.NAME.lock`` beside it, removed when
  released) for the whole export, so a second export to the same ``--out`` stops at once; writes into a hidden staging folder
  ``.NAME.partial-PID`` beside the target; on success swaps it into place (the previous bundle, if
  any, is moved aside to ``.NAME.old-PID`` and removed after the swap); on any error or interrupt
  removes the staging folder and leaves the target as it was.
* Staging folders of exports that died without cleaning up (``kill -9``, a power cut) are removed
  by the next export to the same parent folder, once the lock shows no export to their target is
  running; a target lost between the two renames of a swap is restored from its ``.old`` folder.

SIGTERM is turned into the same interrupt as Ctrl-C by the command line (:func:`sigterm_as_interrupt`).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Callable, Iterator

from mbert.bundle.manifest import KNOWN_FORMATS, MANIFEST
from mbert.modeling.errors import BundleError, read_json

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)$")


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
    why = _not_a_bundle(out)
    if why:
        raise BundleError(f"{out}: --overwrite replaces only a bundle written by mbert-export, and this folder "
                          f"is not one ({why}); choose another --out or remove it yourself")


def _not_a_bundle(folder: Path) -> str:
    path = folder / MANIFEST
    if not path.is_file():
        return f"it has no {MANIFEST}"
    try:
        raw = read_json(path, BundleError)
    except BundleError as exc:
        return str(exc)
    if not isinstance(raw, dict) or raw.get("format_version") not in KNOWN_FORMATS:
        return f"{MANIFEST} has no known mbert-export format_version"
    if not isinstance(raw.get("files"), dict):
        return f"{MANIFEST} has no files table"
    return ""


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
    """Remove the staging and swap folders of dead exports in ``parent``; returns what was removed.

    A leftover belongs to target ``NAME``; it is touched only while no export holds ``NAME``'s lock.
    An ``.old`` folder whose target is missing is the previous bundle of a swap that died between
    its two renames: it is moved back into place instead of being removed. ``held`` names the target
    whose lock this process already holds."""
    removed = []
    if not parent.is_dir():
        return removed
    for path in sorted(parent.iterdir()):
        m = _LEFTOVER.match(path.name)
        if not m or not path.is_dir() or path.is_symlink():
            continue
        lock_path = parent / f".{m['name']}.lock"
        handle = None if m["name"] == held else _acquire(lock_path)
        if handle is None and m["name"] != held:
            continue  # an export to that target is running: its folders are in use
        try:
            target = parent / m["name"]
            if m["kind"] == "old" and not target.exists():
                os.replace(path, target)
                report(f"restored {target} from {path.name} (an earlier export died while swapping it)")
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            report(f"removed {path} (left by an export that did not finish)")
        finally:
            if handle is not None:
                _release(lock_path, handle)
    return removed


@contextlib.contextmanager
def transaction(out: Path, overwrite: bool, report: Callable[[str], None] = lambda m: None) -> Iterator[Path]:
    """Yield an empty staging folder; when the block ends normally it replaces ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with lock(out):
        check_target(out, overwrite)  # again, under the lock
        clean_leftovers(out.parent, report, held=out.name)
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp
            if not (tmp / MANIFEST).is_file():
                raise BundleError(f"{out}: internal error, the bundle has no manifest")
            swap_into_place(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def swap_into_place(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)


def stage_copy(bundle: Path, tmp: Path) -> None:
    """Fill ``tmp`` with hard links (copies across file systems) of every file of ``bundle``. Later
    writes to ``tmp`` replace files (new inodes), so the linked originals stay byte-identical."""
    for dirpath, _dirs, names in os.walk(bundle):
        rel = Path(dirpath).relative_to(bundle)
        (tmp / rel).mkdir(parents=True, exist_ok=True)
        for name in names:
            try:
                os.link(Path(dirpath, name), tmp / rel / name)
            except OSError:
                shutil.copy2(Path(dirpath, name), tmp / rel / name)


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
    error instead (exporters wrap what goes wrong while they trace) must still end as an interrupt."""
    return bool(_signalled)
