"""Tool-call ids: `call_` + 2-digit index + `_` + optional `ET_` + 20 random alphanumerics + 4 checksum digits.

`ET_` marks a call emitted in thinking mode with no reasoning text before it; a
later request's conversion uses the marker to accept the missing reasoning.
The checksum is xxh3-64 of the id without underscores, modulo 10000.
"""

from __future__ import annotations

import secrets
import string

from ._xxh3 import xxh3_64

__all__ = ["new_tool_call_id", "tool_call_id_checksum"]

_ALNUM = string.ascii_letters + string.digits


def tool_call_id_checksum(id_without_checksum: str) -> int:
    return xxh3_64(id_without_checksum.replace("_", "").encode("utf-8")) % 10000


def new_tool_call_id(index: int, empty_thinking: bool) -> str:
    random_part = "".join(secrets.choice(_ALNUM) for _ in range(20))
    mark = "ET_" if empty_thinking else ""
    base = f"call_{index:02d}_{mark}{random_part}"
    return f"{base}{tool_call_id_checksum(base):04d}"
