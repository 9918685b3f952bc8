"""OpenAI Responses event generator and response accumulator."""

from __future__ import annotations

import copy

from .._text import check_text, describe
from ..parsing.stream_processor import FinishReason, PromptUsage
from ._chunk import EventAccumulatedResponse, ProtocolChunk, check_counts, check_identity, now
from .tool_call_id import new_tool_call_id

__all__ = ["ResponsesStreamEvent", "ResponsesChunkGenerator", "ResponsesResponse"]


class ResponsesStreamEvent(ProtocolChunk):
    """A Responses SSE event (`type` is also the event name)."""

    __slots__ = ()


def _new_response(id: str, model: str, created: int, echo=None) -> dict:  # noqa: A002
    r = {
        "id": id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": False,
        "completed_at": None,
        "content_filters": None,
        "error": None,
        "frequency_penalty": 0.0,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "max_tool_calls": None,
        "model": model,
        "moderation": None,
        "output": [],
        "parallel_tool_calls": True,
        "presence_penalty": 0.0,
        "previous_response_id": None,
        "prompt_cache_key": None,
        "prompt_cache_retention": None,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": None,
        "service_tier": "default",
        "store": False,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}, "verbosity": None},
        "tool_choice": "auto",
        "tools": [],
        "top_logprobs": 0,
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "metadata": {},
    }
    if echo is not None:
        _set_echo(r, echo)
    return r


def _check_echo(echo):
    from ..requests.responses_echo import ResponsesEcho

    if echo is not None and not isinstance(echo, ResponsesEcho):
        raise TypeError(f"echo must be a ResponsesEcho or None, got {type(echo).__name__}")
    return echo


def _set_echo(r: dict, echo) -> None:
    r["instructions"] = echo._instructions
    r["max_output_tokens"] = echo._max_output_tokens
    r["reasoning"] = copy.deepcopy(echo._reasoning)
    r["temperature"] = echo._temperature
    r["text"] = copy.deepcopy(echo._text)
    r["tool_choice"] = copy.deepcopy(echo._tool_choice)
    r["tools"] = copy.deepcopy(echo._tools)
    r["top_logprobs"] = echo._top_logprobs
    r["top_p"] = echo._top_p
    r["user"] = echo._user


class ResponsesChunkGenerator:
    """Turns parser events into Responses stream events."""

    def __init__(self, id: str, model: str, thinking_mode: bool, response_options=None) -> None:  # noqa: A002
        self._clock = now
        self._id, self._model = check_identity("ResponsesChunkGenerator", id, model)
        if response_options is not None:
            from ..requests._common import ResponseOptions

            if not isinstance(response_options, ResponseOptions):
                raise TypeError(
                    f"response_options must come from a converted request, got {type(response_options).__name__}"
                )
        self._echo = None if response_options is None else _check_echo(response_options.responses_echo)
        self._namespace_map = None if response_options is None else response_options.namespace_tool_map
        self._response: dict | None = None
        self._active: int | None = None
        self._seq = 0
        self._next_call = 0
        self._thinking = thinking_mode
        self._reasoning = False
        self._prompt_usage = PromptUsage()
        self._started = False
        self._finished = False

    def with_namespace_tool_map(self, namespace_tool_map: dict) -> ResponsesChunkGenerator:
        """`{tool name: (namespace, name within the namespace)}`, as `ResponsesRequest.namespace_tool_map` gives."""
        table = dict(namespace_tool_map)
        for name, target in table.items():
            check_text(name, "a namespace_tool_map key")
            if not isinstance(target, tuple) or len(target) != 2:
                raise TypeError(f"namespace_tool_map values must be (namespace, name) tuples, got {describe(target)}")
            for part in target:
                check_text(part, f"namespace_tool_map[{name!r}]")
        self._namespace_map = table
        return self

    def with_echo(self, echo) -> ResponsesChunkGenerator:
        self._echo = _check_echo(echo)
        if self._response is not None:
            _set_echo(self._response, echo)
        return self

    def _resp(self) -> dict:
        if self._response is None:
            self._response = _new_response(self._id, self._model, self._clock(), self._echo)
        return self._response

    def _n(self) -> int:
        s = self._seq
        self._seq += 1
        return s

    def _ev(self, data: dict) -> ResponsesStreamEvent:
        return ResponsesStreamEvent(data, data["type"])

    def _resolve(self, name: str):
        if self._namespace_map is not None:
            hit = self._namespace_map.get(name)
            return (hit[1], hit[0]) if hit is not None else (name, None)
        if "::" in name:
            ns, local = name.split("::", 1)
            return local, ns
        return name, None

    def _open(self, item: dict, out: list) -> None:
        r = self._resp()
        index = len(r["output"])
        r["output"].append(copy.deepcopy(item))
        item = copy.deepcopy(item)
        part = None
        if item["type"] in ("message", "reasoning") and item["content"]:
            part = item["content"].pop()
        self._active = index
        out.append(
            self._ev(
                {
                    "type": "response.output_item.added",
                    "item": item,
                    "output_index": index,
                    "sequence_number": self._n(),
                }
            )
        )
        if part is not None:
            out.append(
                self._ev(
                    {
                        "type": "response.content_part.added",
                        "content_index": 0,
                        "item_id": item["id"],
                        "output_index": index,
                        "part": part,
                        "sequence_number": self._n(),
                    }
                )
            )

    def _close(self, status: str, out: list) -> None:
        if self._active is None:
            return
        index, self._active = self._active, None
        item = self._resp()["output"][index]
        item["status"] = status
        item = copy.deepcopy(item)
        if item["type"] in ("message", "reasoning"):
            for ci, part in enumerate(item["content"]):
                if part["type"] == "output_text":
                    out.append(
                        self._ev(
                            {
                                "type": "response.output_text.done",
                                "content_index": ci,
                                "item_id": item["id"],
                                "logprobs": copy.deepcopy(part["logprobs"]),
                                "output_index": index,
                                "sequence_number": self._n(),
                                "text": part["text"],
                            }
                        )
                    )
                else:
                    out.append(
                        self._ev(
                            {
                                "type": "response.reasoning_text.done",
                                "content_index": ci,
                                "item_id": item["id"],
                                "output_index": index,
                                "sequence_number": self._n(),
                                "text": part["text"],
                            }
                        )
                    )
                out.append(
                    self._ev(
                        {
                            "type": "response.content_part.done",
                            "content_index": ci,
                            "item_id": item["id"],
                            "output_index": index,
                            "part": copy.deepcopy(part),
                            "sequence_number": self._n(),
                        }
                    )
                )
        elif item["type"] == "function_call":
            out.append(
                self._ev(
                    {
                        "type": "response.function_call_arguments.done",
                        "arguments": item["arguments"],
                        "item_id": item["id"],
                        "output_index": index,
                        "sequence_number": self._n(),
                    }
                )
            )
        out.append(
            self._ev(
                {
                    "type": "response.output_item.done",
                    "item": item,
                    "output_index": index,
                    "sequence_number": self._n(),
                }
            )
        )

    def _append_text(self, delta: str, reasoning: bool, out: list, logprobs=None) -> None:
        r = self._resp()
        current = r["output"][self._active] if self._active is not None else None
        want = "reasoning" if reasoning else "message"
        if current is None or current["type"] != want:
            self._close("completed", out)
            index = len(r["output"])
            if reasoning:
                item = {
                    "type": "reasoning",
                    "id": f"rs_{self._id}_{index}",
                    "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}],
                    "summary": [],
                    "encrypted_content": f"{self._id}-0",
                }
            else:
                item = {
                    "type": "message",
                    "id": f"msg_{self._id}_{index}",
                    "status": "in_progress",
                    "role": "assistant",
                    "phase": "final_answer",
                    "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": ""}],
                }
            self._open(item, out)
        index = self._active
        item = r["output"][index]
        item["content"][0]["text"] += delta
        delta_logprobs = [] if reasoning or logprobs is None else copy.deepcopy(logprobs)
        if not reasoning:
            item["content"][0]["logprobs"].extend(copy.deepcopy(delta_logprobs))
        if reasoning:
            out.append(
                self._ev(
                    {
                        "type": "response.reasoning_text.delta",
                        "content_index": 0,
                        "delta": delta,
                        "item_id": item["id"],
                        "output_index": index,
                        "sequence_number": self._n(),
                    }
                )
            )
        else:
            out.append(
                self._ev(
                    {
                        "type": "response.output_text.delta",
                        "content_index": 0,
                        "delta": delta,
                        "item_id": item["id"],
                        "logprobs": delta_logprobs,
                        "output_index": index,
                        "sequence_number": self._n(),
                    }
                )
            )

    def generate(self, ev) -> list:
        k = ev.kind
        if self._finished or (not self._started and k != "start"):
            return []
        out: list = []
        if k == "start":
            if self._started:
                return out
            self._started = True
            self._prompt_usage = ev.prompt_usage
            r = self._resp()
            out.append(
                self._ev(
                    {"type": "response.created", "response": copy.deepcopy(r), "sequence_number": self._n()}
                )
            )
            out.append(
                self._ev(
                    {
                        "type": "response.in_progress",
                        "response": copy.deepcopy(r),
                        "sequence_number": self._n(),
                    }
                )
            )
        elif k == "content":
            self._append_text(ev.content, False, out, ev.logprobs)
        elif k == "reasoning":
            if ev.content:
                self._reasoning = True
            self._append_text(ev.content, True, out)
        elif k == "tool_call_named":
            r = self._resp()
            if self._active is not None and r["output"][self._active]["type"] == "message":
                r["output"][self._active]["phase"] = "commentary"
            self._close("completed", out)
            index = len(r["output"])
            call_id = new_tool_call_id(self._next_call, self._thinking and not self._reasoning)
            name, namespace = self._resolve(ev.tool_name)
            item = {
                "type": "function_call",
                "id": f"fc_{self._id}_{index}",
                "status": "in_progress",
                "call_id": call_id,
                "name": name,
            }
            if namespace is not None:
                item["namespace"] = namespace
            item["arguments"] = ""
            self._next_call += 1
            self._open(item, out)
        elif k == "arguments":
            r = self._resp()
            if self._active is not None and r["output"][self._active]["type"] == "function_call":
                item = r["output"][self._active]
                item["arguments"] += ev.arguments
                out.append(
                    self._ev(
                        {
                            "type": "response.function_call_arguments.delta",
                            "delta": ev.arguments,
                            "item_id": item["id"],
                            "output_index": self._active,
                            "sequence_number": self._n(),
                        }
                    )
                )
        elif k == "finish":
            r = self._resp()
            reason = {
                FinishReason.Length: "max_output_tokens",
                FinishReason.ContentFilter: "content_filter",
            }.get(ev.finish_reason)
            r["incomplete_details"] = None if reason is None else {"reason": reason}
            r["status"] = "incomplete" if reason is not None else "completed"
            pu = self._prompt_usage
            r["usage"] = {
                "input_tokens": pu.prompt_tokens,
                "input_tokens_details": {"cached_tokens": pu.prompt_cache_hit_tokens},
                "output_tokens": ev.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": ev.reasoning_tokens or 0},
                "total_tokens": pu.prompt_tokens + ev.completion_tokens,
            }
            r["completed_at"] = self._clock()
            self._close(r["status"], out)
            kind = "response.incomplete" if r["status"] == "incomplete" else "response.completed"
            out.append(self._ev({"type": kind, "response": copy.deepcopy(r), "sequence_number": self._n()}))
            self._finished = True
        return out


class ResponsesResponse(EventAccumulatedResponse):
    """The non-streamed Responses object built by accumulating events."""

    def __init__(
        self, id: str, model: str, created: int, prompt_tokens: int = 0, prompt_cache_hit_tokens: int = 0
    ) -> None:  # noqa: A002
        id, model = check_identity("ResponsesResponse", id, model)  # noqa: A001
        check_counts(
            "ResponsesResponse",
            created=created,
            prompt_tokens=prompt_tokens,
            prompt_cache_hit_tokens=prompt_cache_hit_tokens,
        )
        self._data = _new_response(id, model, created)

    def accumulate(self, event: ResponsesStreamEvent) -> None:
        if not isinstance(event, ResponsesStreamEvent):
            raise TypeError(f"accumulate expects a ResponsesStreamEvent, got {type(event).__name__}")
        e = event._take()
        t = e["type"]
        out = self._data["output"]
        if t in ("response.created", "response.in_progress", "response.completed", "response.incomplete"):
            self._data = copy.deepcopy(e["response"])
        elif t == "response.output_item.added":
            if e["output_index"] == len(out):
                out.append(copy.deepcopy(e["item"]))
        elif t == "response.output_item.done":
            i = e["output_index"]
            if i < len(out) and out[i]["id"] == e["item"]["id"] and out[i]["type"] == e["item"]["type"]:
                out[i] = copy.deepcopy(e["item"])
        else:
            i = e.get("output_index")
            if i is None or i >= len(out) or out[i]["id"] != e.get("item_id"):
                return
            item = out[i]
            if t == "response.content_part.added":
                if e["content_index"] == len(item.get("content", [])):
                    item["content"].append(copy.deepcopy(e["part"]))
            elif t == "response.content_part.done":
                ci = e["content_index"]
                if ci < len(item.get("content", [])):
                    item["content"][ci] = copy.deepcopy(e["part"])
            elif t in ("response.output_text.delta", "response.reasoning_text.delta"):
                ci = e["content_index"]
                if ci < len(item.get("content", [])):
                    item["content"][ci]["text"] += e["delta"]
                    if t == "response.output_text.delta":
                        item["content"][ci]["logprobs"].extend(copy.deepcopy(e["logprobs"]))
            elif t in ("response.output_text.done", "response.reasoning_text.done"):
                ci = e["content_index"]
                if ci < len(item.get("content", [])):
                    item["content"][ci]["text"] = e["text"]
                    if t == "response.output_text.done":
                        item["content"][ci]["logprobs"] = copy.deepcopy(e["logprobs"])
            elif t == "response.function_call_arguments.delta" and item["type"] == "function_call":
                item["arguments"] += e["delta"]
            elif t == "response.function_call_arguments.done" and item["type"] == "function_call":
                item["arguments"] = e["arguments"]
