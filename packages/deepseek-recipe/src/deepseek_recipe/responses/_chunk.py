"""Protocol chunk objects (a JSON-like payload with `to_json()`), and the shared tail of the
event-accumulating (Messages, Responses) response objects."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

from .._text import check_text

__all__ = ["EventAccumulatedResponse", "ProtocolChunk", "now", "check_identity", "check_counts"]


def now() -> int:
    return int(time.time())


def check_identity(owner: str, id: Any, model: Any) -> tuple[str, str]:  # noqa: A002 - official name
    """The response id and model name of a generator/response: str, valid Unicode (they end up in JSON)."""
    return check_text(id, f"{owner} id"), check_text(model, f"{owner} model")


def check_counts(owner: str, **counts: Any) -> None:
    """Each count (timestamp, token count) must be a non-negative int."""
    for name, value in counts.items():
        if type(value) is not int:
            raise TypeError(f"{owner} {name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{owner} {name} must be non-negative, got {value}")


class ProtocolChunk:
    """One protocol chunk/event; `data` is the JSON payload, `event` the SSE event name (or None).

    Like the reference, a response's `accumulate(chunk)` consumes the chunk: using it afterwards
    raises RuntimeError (serialize or name it before accumulating).
    """

    __slots__ = ("_data", "_event", "_consumed")

    def __init__(self, data: dict, event: str | None = None) -> None:
        self._data = data
        self._event = event
        self._consumed = False

    def _check(self) -> None:
        if self._consumed:
            raise RuntimeError(f"this {type(self).__name__} has been consumed by accumulate()")

    def _take(self) -> dict:
        """Mark consumed and hand the payload to an accumulator."""
        self._check()
        self._consumed = True
        return self._data

    @property
    def data(self) -> dict:
        self._check()
        return self._data

    @property
    def event(self) -> str | None:
        self._check()
        return self._event

    def to_json(self) -> str:
        self._check()
        return json.dumps(self._data, ensure_ascii=False, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        self._check()
        return copy.deepcopy(self._data)

    def __repr__(self) -> str:
        if self._consumed:
            return f"{type(self).__name__}(<consumed>)"
        return f"{type(self).__name__}({self.to_json()[:120]})"


class EventAccumulatedResponse:
    """Base of the responses built from typed SSE events (Messages, Responses): `self._data` is the
    accumulated object, each event is named by its `type`, and the stream ends without a done sentinel."""

    _data: dict

    def to_dict(self) -> dict:
        return copy.deepcopy(self._data)

    def to_json(self) -> str:
        return json.dumps(self._data, ensure_ascii=False, separators=(",", ":"))

    @staticmethod
    def sse_event_name(chunk) -> str | None:
        if not isinstance(chunk, ProtocolChunk):
            raise TypeError(f"sse_event_name expects a protocol event, got {type(chunk).__name__}")
        return chunk.data["type"]

    @staticmethod
    def sse_done_data() -> str | None:
        return None
