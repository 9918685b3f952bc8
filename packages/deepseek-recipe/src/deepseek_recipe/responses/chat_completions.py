"""Chat Completions chunk generator and response accumulator."""

from __future__ import annotations

import copy
import json

from ..parsing.stream_processor import FinishReason, PromptUsage
from ._chunk import ProtocolChunk, check_counts, check_identity, now
from .tool_call_id import new_tool_call_id

__all__ = ["ChatCompletionChunk", "ChatCompletionChunkGenerator", "ChatCompletionResponse"]

_FINISH = {
    FinishReason.Stop: "stop",
    FinishReason.StopSequence: "stop",
    FinishReason.EndOfStream: "stop",
    FinishReason.ToolCalls: "tool_calls",
    FinishReason.ContentFilter: "content_filter",
    FinishReason.Length: "length",
}


class ChatCompletionChunk(ProtocolChunk):
    """A `chat.completion.chunk` object."""

    __slots__ = ()


def _usage(prompt: PromptUsage, completion_tokens: int, reasoning_tokens, thinking: bool) -> dict:
    u = {
        "prompt_tokens": prompt.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": prompt.prompt_cache_hit_tokens},
    }
    if thinking and reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    u["prompt_cache_hit_tokens"] = prompt.prompt_cache_hit_tokens
    u["prompt_cache_miss_tokens"] = max(prompt.prompt_tokens - prompt.prompt_cache_hit_tokens, 0)
    return u


class ChatCompletionChunkGenerator:
    """Turns parser events into Chat Completions chunks."""

    def __init__(
        self,
        id: str,
        model: str,
        *,
        include_usage: bool,
        thinking_mode: bool,
        starts_in_reasoning: bool | None = None,
    ) -> None:  # noqa: A002
        self._id, self._model = check_identity("ChatCompletionChunkGenerator", id, model)
        self._clock = now
        self._created = None
        self._thinking = thinking_mode
        self._starts_in_reasoning = thinking_mode if starts_in_reasoning is None else starts_in_reasoning
        self._include_usage = include_usage
        self._next_index = 0
        self._reasoning = False
        self._prompt_usage = PromptUsage()
        self._fingerprint = None

    def _chunk(self, delta: dict, finish_reason=None, usage=None, logprobs=None) -> list:
        if self._created is None:
            self._created = self._clock()
        data = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "system_fingerprint": self._fingerprint,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if self._include_usage or usage is not None:
            data["usage"] = usage
        return [ChatCompletionChunk(data)]

    def generate(self, ev) -> list:
        k = ev.kind
        if k == "start":
            self._prompt_usage = ev.prompt_usage
            self._fingerprint = ev.system_fingerprint
            delta: dict = {"role": "assistant"}
            if self._starts_in_reasoning:
                delta["content"] = None
                delta["reasoning_content"] = ""
            else:
                delta["content"] = ""
                if self._thinking:
                    delta["reasoning_content"] = None
            return self._chunk(delta)
        if k == "content":
            delta = {"content": ev.content}
            if self._thinking:
                delta["reasoning_content"] = None
            lp = None if ev.logprobs is None else {"content": copy.deepcopy(ev.logprobs)}
            return self._chunk(delta, logprobs=lp)
        if k == "reasoning":
            if ev.content:
                self._reasoning = True
            lp = None if ev.logprobs is None else {"reasoning_content": copy.deepcopy(ev.logprobs)}
            return self._chunk({"content": None, "reasoning_content": ev.content}, logprobs=lp)
        if k == "tool_call_begin":
            return []
        if k == "tool_call_named":
            index = self._next_index
            self._next_index += 1
            call_id = new_tool_call_id(index, self._thinking and not self._reasoning)
            return self._chunk(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": ev.tool_name, "arguments": ""},
                        }
                    ]
                }
            )
        if k == "arguments":
            if self._next_index == 0:
                return []
            return self._chunk(
                {"tool_calls": [{"index": self._next_index - 1, "function": {"arguments": ev.arguments}}]}
            )
        # finish
        delta = {"content": ""}
        if self._thinking:
            delta["reasoning_content"] = None
        usage = _usage(self._prompt_usage, ev.completion_tokens, ev.reasoning_tokens, self._thinking)
        return self._chunk(delta, _FINISH[ev.finish_reason], usage)


class ChatCompletionResponse:
    """The non-streamed `chat.completion` object built by accumulating chunks."""

    def __init__(
        self, id: str, model: str, created: int, prompt_tokens: int = 0, prompt_cache_hit_tokens: int = 0
    ) -> None:  # noqa: A002
        id, model = check_identity("ChatCompletionResponse", id, model)  # noqa: A001
        check_counts(
            "ChatCompletionResponse",
            created=created,
            prompt_tokens=prompt_tokens,
            prompt_cache_hit_tokens=prompt_cache_hit_tokens,
        )
        self._data: dict = {
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [],
            "system_fingerprint": None,
        }
        self._usage = None

    def accumulate(self, chunk: ChatCompletionChunk) -> None:
        if not isinstance(chunk, ChatCompletionChunk):
            raise TypeError(f"accumulate expects a ChatCompletionChunk, got {type(chunk).__name__}")
        data = chunk._take()
        if data.get("usage") is not None:
            self._usage = copy.deepcopy(data["usage"])
        if self._data["system_fingerprint"] is None:
            self._data["system_fingerprint"] = data.get("system_fingerprint")
        for cc in data["choices"]:
            choice = next((c for c in self._data["choices"] if c["index"] == cc["index"]), None)
            if choice is None:
                choice = {
                    "index": cc["index"],
                    "message": {"role": "assistant", "content": None},
                    "logprobs": None,
                    "finish_reason": None,
                }
                self._data["choices"].append(choice)
            msg = choice["message"]
            delta = cc["delta"]
            for key in ("content", "reasoning_content"):
                v = delta.get(key)
                if v is not None:
                    msg[key] = (msg.get(key) or "") + v
            if delta.get("tool_calls") is not None:
                calls = msg.setdefault("tool_calls", [])
                for td in delta["tool_calls"]:
                    if "id" in td:
                        calls.append(copy.deepcopy(td))
                    else:
                        for c in calls:
                            if c["index"] == td["index"]:
                                c["function"]["arguments"] += td["function"]["arguments"]
                                break
            lp = cc.get("logprobs")
            if lp is not None:
                if choice["logprobs"] is None:
                    choice["logprobs"] = copy.deepcopy(lp)
                else:
                    for key, entries in lp.items():
                        choice["logprobs"].setdefault(key, []).extend(copy.deepcopy(entries))
            if cc.get("finish_reason") is not None:
                choice["finish_reason"] = cc["finish_reason"]

    def to_dict(self) -> dict:
        d = copy.deepcopy(self._data)
        for c in d["choices"]:
            m = c["message"]
            ordered = {"role": m["role"], "content": m.get("content")}
            if m.get("reasoning_content") is not None:
                ordered["reasoning_content"] = m["reasoning_content"]
            if m.get("tool_calls") is not None:
                ordered["tool_calls"] = m["tool_calls"]
            c["message"] = ordered
        if self._usage is not None:
            d["usage"] = self._usage
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))

    @staticmethod
    def sse_event_name(chunk) -> str | None:
        if not isinstance(chunk, ChatCompletionChunk):
            raise TypeError(f"sse_event_name expects a ChatCompletionChunk, got {type(chunk).__name__}")
        chunk._check()
        return None

    @staticmethod
    def sse_done_data() -> str | None:
        return "[DONE]"
