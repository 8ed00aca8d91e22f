"""Ownership of the tool's temporary folders: a folder is cleaned up only when a marker this tool wrote
says so, and only once the process that wrote it is gone.

A marker is a small JSON file *beside* its folder (``FOLDER.mbert-owner``; inside, it would be a file
the sealed bundle does not list): the tool's name, the kind of folder, the pid, and the process's start
time and the machine's boot id, so a pid reused by another process, or a marker from before a reboot,
reads as gone. A folder without a valid marker is never touched, whatever its name. The marker is
written before its folder is made and removed after its folder is gone, so a folder of this tool
never lacks one.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

TOOL = "mbert-export"
SUFFIX = ".mbert-owner"


def marker_of(folder: Path) -> Path:
    return folder.with_name(folder.name + SUFFIX)


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot: /proc/PID/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)" start at field 3


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Owner:
    tool: str
    kind: str  # "partial" (an export being written), "old" (a replaced bundle), "serve" (a serve folder)
    pid: int
    start: int | None
    boot: str

    @classmethod
    def me(cls, kind: str) -> "Owner":
        return cls(TOOL, kind, os.getpid(), _proc_start(os.getpid()), _boot_id())

    def alive(self) -> bool:
        """Whether the process that wrote this marker still runs (same pid, start time and boot)."""
        if self.boot and self.boot != _boot_id():
            return False
        start = _proc_start(self.pid)
        if start is not None or Path("/proc").is_dir():
            return start is not None and start == self.start
        try:  # no /proc: the pid alone
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def claim(folder: Path, kind: str) -> Owner:
    """Write ``folder``'s marker (before the folder is made); returns it."""
    owner = Owner.me(kind)
    marker_of(folder).write_text(json.dumps(asdict(owner)) + "\n", encoding="utf-8")
    return owner


def owner_of(folder: Path) -> Owner | None:
    """The valid marker of ``folder`` written by this tool, or None (no marker, unreadable, another
    tool's, a symbolic link or not a regular file)."""
    marker = marker_of(folder)
    try:
        if not marker.is_file() or marker.is_symlink() or marker.stat().st_size > 4096:
            return None
        raw = json.loads(marker.read_text(encoding="utf-8"))
        owner = Owner(raw["tool"], raw["kind"], int(raw["pid"]), raw["start"], str(raw["boot"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return owner if owner.tool == TOOL else None


def release(folder: Path) -> None:
    """Remove ``folder``'s marker (after the folder itself is gone)."""
    marker_of(folder).unlink(missing_ok=True)


def abandoned(folder: Path, kind: str) -> bool:
    """True when ``folder`` is a real folder of this tool, of ``kind``, whose process is gone."""
    owner = owner_of(folder)
    return (owner is not None and owner.kind == kind and folder.is_dir() and not folder.is_symlink()
            and not owner.alive())
