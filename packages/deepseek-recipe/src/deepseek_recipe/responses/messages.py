"""Anthropic Messages event generator and response accumulator."""

from __future__ import annotations

import copy

from .. import _json
from .._text import check_text
from ..parsing.stream_processor import FinishReason, PromptUsage
from ._chunk import EventAccumulatedResponse, ProtocolChunk, check_counts, check_identity
from .tool_call_id import new_tool_call_id

__all__ = ["MessagesStreamEvent", "MessagesChunkGenerator", "MessagesResponse"]

_STOP = {
    FinishReason.Stop: "end_turn",
    FinishReason.EndOfStream: "end_turn",
    FinishReason.Length: "max_tokens",
    FinishReason.StopSequence: "stop_sequence",
    FinishReason.ToolCalls: "tool_use",
    FinishReason.ContentFilter: "refusal",
}


class MessagesStreamEvent(ProtocolChunk):
    """A Messages SSE event (`type` is also the event name)."""

    __slots__ = ()


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {
        "input_tokens": max(prompt_tokens - cached, 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def _message(id: str, model: str, prompt_tokens: int, cached: int) -> dict:  # noqa: A002
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(prompt_tokens, cached, 0),
    }


class MessagesChunkGenerator:
    """Turns parser events into Messages stream events."""

    def __init__(self, id: str, model: str, thinking_mode: bool) -> None:  # noqa: A002
        self._id, self._model = check_identity("MessagesChunkGenerator", id, model)
        self._thinking = thinking_mode
        self._signature = id
        self._index = 0
        self._next_call = 0
        self._reasoning = False
        self._active: str | None = None
        self._prompt_usage = PromptUsage()
        self._started = False
        self._finished = False
        self._clock = None

    def with_signature(self, signature: str) -> MessagesChunkGenerator:
        self._signature = check_text(signature, "MessagesChunkGenerator signature")
        return self

    def _ev(self, data: dict) -> MessagesStreamEvent:
        return MessagesStreamEvent(data, data["type"])

    def _close(self, out: list) -> None:
        if self._active is None:
            return
        if self._active == "thinking":
            out.append(
                self._ev(
                    {
                        "type": "content_block_delta",
                        "index": self._index,
                        "delta": {"type": "signature_delta", "signature": self._signature},
                    }
                )
            )
        out.append(self._ev({"type": "content_block_stop", "index": self._index}))
        self._index += 1
        self._active = None

    def _open(self, kind: str, block: dict, out: list) -> None:
        self._close(out)
        out.append(self._ev({"type": "content_block_start", "index": self._index, "content_block": block}))
        if self._index == 0:
            out.append(self._ev({"type": "ping"}))
        self._active = kind

    def _delta(self, delta: dict) -> MessagesStreamEvent:
        return self._ev({"type": "content_block_delta", "index": self._index, "delta": delta})

    def generate(self, ev) -> list:
        if self._finished:
            return []
        out: list = []
        k = ev.kind
        if k == "start":
            if self._started:
                return out
            self._started = True
            self._prompt_usage = pu = ev.prompt_usage
            out.append(
                self._ev(
                    {
                        "type": "message_start",
                        "message": _message(
                            self._id, self._model, pu.prompt_tokens, pu.prompt_cache_hit_tokens
                        ),
                    }
                )
            )
            if self._thinking:
                self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, out)
        elif k == "content":
            if self._active != "text":
                self._open("text", {"type": "text", "text": ""}, out)
            out.append(self._delta({"type": "text_delta", "text": ev.content}))
        elif k == "reasoning":
            if self._active != "thinking":
                self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, out)
            if ev.content:
                self._reasoning = True
            out.append(self._delta({"type": "thinking_delta", "thinking": ev.content}))
        elif k == "tool_call_named":
            call_id = new_tool_call_id(self._next_call, self._thinking and not self._reasoning)
            self._next_call += 1
            self._open(
                "tool_use", {"type": "tool_use", "id": call_id, "name": ev.tool_name, "input": {}}, out
            )
        elif k == "arguments":
            if self._active == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": ev.arguments}))
        elif k == "finish":
            self._close(out)
            pu = self._prompt_usage
            out.append(
                self._ev(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": _STOP[ev.finish_reason], "stop_sequence": ev.stop_sequence},
                        "usage": _usage(pu.prompt_tokens, pu.prompt_cache_hit_tokens, ev.completion_tokens),
                    }
                )
            )
            out.append(self._ev({"type": "message_stop"}))
            self._finished = True
        return out


class MessagesResponse(EventAccumulatedResponse):
    """The non-streamed Messages response built by accumulating events."""

    def __init__(
        self, id: str, model: str, created: int = 0, prompt_tokens: int = 0, prompt_cache_hit_tokens: int = 0
    ) -> None:  # noqa: A002
        id, model = check_identity("MessagesResponse", id, model)  # noqa: A001
        check_counts(
            "MessagesResponse",
            created=created,
            prompt_tokens=prompt_tokens,
            prompt_cache_hit_tokens=prompt_cache_hit_tokens,
        )
        self._data = _message(id, model, prompt_tokens, prompt_cache_hit_tokens)
        self._partial: dict[int, str] = {}

    def accumulate(self, event: MessagesStreamEvent) -> None:
        if not isinstance(event, MessagesStreamEvent):
            raise TypeError(f"accumulate expects a MessagesStreamEvent, got {type(event).__name__}")
        e = event._take()
        t = e["type"]
        content = self._data["content"]
        if t == "message_start":
            self._data = copy.deepcopy(e["message"])
            self._partial = {}
        elif t == "content_block_start":
            if e["index"] == len(content):
                content.append(copy.deepcopy(e["content_block"]))
        elif t == "content_block_delta":
            i = e["index"]
            if i >= len(content):
                return
            block, delta = content[i], e["delta"]
            pair = (block["type"], delta["type"])
            if pair == ("text", "text_delta"):
                block["text"] += delta["text"]
            elif pair == ("thinking", "thinking_delta"):
                block["thinking"] += delta["thinking"]
            elif pair == ("thinking", "signature_delta"):
                block["signature"] += delta["signature"]
            elif pair == ("tool_use", "input_json_delta"):
                self._partial[i] = self._partial.get(i, "") + delta["partial_json"]
        elif t == "content_block_stop":
            i = e["index"]
            text = self._partial.pop(i, None)
            if text is not None and i < len(content) and content[i]["type"] == "tool_use":
                try:
                    content[i]["input"] = _json.loads(text)
                except ValueError:
                    content[i]["input"] = {}
        elif t == "message_delta":
            self._data["stop_reason"] = e["delta"]["stop_reason"]
            self._data["stop_sequence"] = e["delta"]["stop_sequence"]
            self._data["usage"] = copy.deepcopy(e["usage"])
