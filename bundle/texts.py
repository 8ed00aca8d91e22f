"""Texts used to validate exported models on real input and to calibrate FP16 overflow scans.

:func:`calibration_texts` returns the built-in set that ships with the package (the ``.txt``
files of ``mbert/bundle/texts/``, one document per file: queries of a few words up to a
document of several thousand tokens; prose, dialogue, legal text, mixed languages, markdown,
JSON, logs, tables and source code).  :func:`load_text_file` reads a user's own file.
"""
from __future__ import annotations

import functools
import json
import os
from importlib.resources import files
from pathlib import Path

from mbert.bundle.errors import TextFileError
from mbert.bundle.files import TEXT_LIMIT, read_bounded

__all__ = ["calibration_texts", "load_text_file"]


@functools.lru_cache(maxsize=1)
def _builtin_texts() -> tuple[str, ...]:
    folder = files("mbert.bundle") / "texts"
    entries = sorted(
        (entry for entry in folder.iterdir() if entry.name.endswith(".txt") and entry.is_file()),
        key=lambda entry: entry.name,
    )
    texts = tuple(entry.read_text(encoding="utf-8").rstrip("\r\n") for entry in entries)
    if not texts:  # a broken install (package data left out of the wheel)
        raise TextFileError(f"{folder}: no built-in calibration texts found (*.txt)")
    return texts


def calibration_texts() -> list[str]:
    """All built-in calibration/validation documents, in file-name order (a fresh list)."""
    return list(_builtin_texts())


def _line_of_offset(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def load_text_file(path: str | os.PathLike[str]) -> list[str]:
    """Read a user's text file: one text per entry.

    * ``*.jsonl``: one JSON value per non-blank line, either a string or an object with a
      string ``"text"`` key.
    * anything else: plain UTF-8 text, one text per non-blank line (line ends removed).

    Raises :class:`~mbert.bundle.errors.TextFileError`, naming the file (and the line
    where there is one), when the file is missing, unreadable, not UTF-8, holds no text,
    or has a malformed JSONL line.
    """
    p = Path(path)
    data = read_bounded(p, TEXT_LIMIT, TextFileError, "text file")
    try:
        content = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        # exc.object is the data the codec saw (utf-8-sig drops a leading BOM first).
        offset = exc.start + len(data) - len(exc.object)
        line = _line_of_offset(data, offset)
        raise TextFileError(
            f"{p}:{line}: not valid UTF-8 (byte 0x{data[offset]:02x} at offset {offset})"
        ) from None

    is_jsonl = p.suffix.lower() == ".jsonl"
    texts: list[str] = []
    for number, raw in enumerate(content.split("\n"), start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        if not is_jsonl:
            texts.append(line)
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TextFileError(f"{p}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if isinstance(value, dict):
            if "text" not in value:
                raise TextFileError(f'{p}:{number}: JSON object has no "text" key')
            value = value["text"]
            if not isinstance(value, str):
                raise TextFileError(
                    f'{p}:{number}: "text" must be a string, got {type(value).__name__}'
                )
        elif not isinstance(value, str):
            raise TextFileError(
                f'{p}:{number}: expected a JSON string or an object with a "text" key, '
                f"got {type(value).__name__}"
            )
        if not value.strip():
            raise TextFileError(f"{p}:{number}: empty text")
        texts.append(value)

    if not texts:
        raise TextFileError(f"{p}: text file is empty (no non-blank lines)")
    return texts
