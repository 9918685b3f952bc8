"""Protocol chunk objects: a JSON-like payload with `to_json()`."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

__all__ = ["ProtocolChunk", "now"]


def now() -> int:
    return int(time.time())


class ProtocolChunk:
    """One protocol chunk/event; `data` is the JSON payload, `event` the SSE event name (or None)."""

    __slots__ = ("data", "event")

    def __init__(self, data: dict, event: str | None = None) -> None:
        self.data = data
        self.event = event

    def to_json(self) -> str:
        return json.dumps(self.data, ensure_ascii=False, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_json()[:120]})"
