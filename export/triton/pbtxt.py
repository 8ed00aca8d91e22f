"""A tiny deterministic writer of protobuf text format (Triton's ``config.pbtxt``) from nested
Python data: key order is kept, so equal input gives byte-identical output."""
from __future__ import annotations

import re
from typing import Any, Sequence

__all__ = ["Enum", "to_pbtxt"]


class Enum(str):
    """A protobuf enum value, written unquoted (``KIND_GPU``, ``TYPE_INT64``)."""


def to_pbtxt(message: dict[str, Any], comments: Sequence[str] = ()) -> str:
    """Protobuf text format for nested dicts: dict -> ``key { }``, list of dicts ->
    ``key [ { }, { } ]``, list of scalars -> ``key: [ a, b ]``, ``None`` / ``[]`` omitted.
    Key order is kept, so equal input gives byte-identical output."""
    lines = [f"# {line}".rstrip() for c in comments for line in c.splitlines()]
    return "\n".join(lines + _message_lines(message, "")) + "\n"


def _message_lines(message: dict[str, Any], pad: str) -> list[str]:
    lines: list[str] = []
    inner = pad + "  "
    for key, value in message.items():
        if value is None or (isinstance(value, list) and not value):
            continue
        if isinstance(value, dict):
            lines += [f"{pad}{key} {{", *_message_lines(value, inner), f"{pad}}}"]
        elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
            lines.append(f"{pad}{key} [")
            for i, item in enumerate(value):
                closing = "}," if i < len(value) - 1 else "}"
                lines += [f"{inner}{{", *_message_lines(item, inner + "  "), inner + closing]
            lines.append(f"{pad}]")
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [ {', '.join(_scalar(v) for v in value)} ]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return lines


def _scalar(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        escaped = escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
        return '"' + re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\{ord(m.group()):03o}", escaped) + '"'
    raise TypeError(f"cannot write {value!r} as a protobuf text scalar")
