"""`ResponsesEcho`: its own module so the response builders (responses/responses.py) can check it without
importing the request parser, which imports them (no import cycle)."""

from __future__ import annotations

from typing import Any

__all__ = ["ResponsesEcho"]


class ResponsesEcho:
    """Request settings that Responses response objects report, as the request specified them."""

    def __init__(self) -> None:
        self._instructions = None
        self._max_output_tokens = None
        self._reasoning = {"effort": None, "summary": None}
        self._temperature = 1.0
        self._text = {"format": {"type": "text"}, "verbosity": None}
        self._tool_choice: Any = "auto"
        self._tools: list = []
        self._top_logprobs = 0
        self._top_p = 1.0
        self._user = None

    instructions = property(lambda self: self._instructions)
    max_output_tokens = property(lambda self: self._max_output_tokens)
    temperature = property(lambda self: self._temperature)
    top_p = property(lambda self: self._top_p)
    top_logprobs = property(lambda self: self._top_logprobs)
    user = property(lambda self: self._user)
