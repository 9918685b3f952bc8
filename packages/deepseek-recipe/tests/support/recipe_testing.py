"""Helpers for tests and golden replay: build objects from the golden corpus's JSON shapes."""

from __future__ import annotations

from typing import Any

from deepseek_recipe.messages import (
    AssistantMessage,
    Conversation,
    LatestReminderMessage,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from deepseek_recipe.options import ConversionOptions, ReasoningContentBehavior, WebSearchBehavior

__all__ = [
    "build_conversation",
    "conversion_options",
    "request_class",
    "convert_request",
    "golden_dir",
    "golden_cases",
    "golden_params",
    "drive_stream",
    "normalize",
]


def _tool(t: dict) -> ToolDefinition:
    return ToolDefinition(
        t["name"], t.get("description"), t.get("parameters"), t.get("strict"), t.get("defer_loading", False)
    )


def build_conversation(spec: dict) -> Conversation:
    """A `Conversation` from the corpus's `conversation_spec` shape."""
    messages = []
    for m in spec["messages"]:
        role = m["role"]
        if role == "system":
            tools = m.get("tools")
            messages.append(
                SystemMessage(m["content"], tools=None if tools is None else [_tool(t) for t in tools])
            )
        elif role == "user":
            messages.append(UserMessage(m["content"]))
        elif role == "assistant":
            calls = m.get("tool_calls")
            messages.append(
                AssistantMessage(
                    m["content"],
                    m.get("reasoning_content"),
                    None if calls is None else [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls],
                    m.get("prefix", False),
                )
            )
        elif role == "tool":
            messages.append(ToolMessage(m["content"], m.get("tool_call_id")))
        else:
            messages.append(LatestReminderMessage(m["content"]))
    kwargs: dict[str, Any] = {
        k: spec[k]
        for k in (
            "thinking_mode",
            "tool_choice",
            "reasoning_effort",
            "response_format",
            "response_schema",
            "response_regex",
        )
        if k in spec
    }
    return Conversation(messages, tools=[_tool(t) for t in spec.get("tools", ())], **kwargs)


def conversion_options(opts: dict) -> ConversionOptions:
    """`ConversionOptions` from the corpus's `options` shape (absent key = default)."""
    kw: dict[str, Any] = {}
    if "default_thinking_mode" in opts:
        kw["default_thinking_mode"] = opts["default_thinking_mode"]
    if "reasoning_content_behavior" in opts:
        kw["reasoning_content_behavior"] = ReasoningContentBehavior(opts["reasoning_content_behavior"])
    if "responses_web_search" in opts:
        kw["responses_web_search"] = WebSearchBehavior(opts["responses_web_search"])
    if "messages_web_search" in opts:
        kw["messages_web_search"] = WebSearchBehavior(opts["messages_web_search"])
    for k in ("thinking_max_tokens_upper_bound", "non_thinking_max_tokens_upper_bound"):
        if k in opts:
            kw[k] = opts[k]
    return ConversionOptions(**kw)


def request_class(api: str):
    from deepseek_recipe.requests.chat_completions import ChatCompletionRequest
    from deepseek_recipe.requests.messages import MessagesRequest
    from deepseek_recipe.requests.responses import ResponsesRequest

    return {
        "chat_completions": ChatCompletionRequest,
        "messages": MessagesRequest,
        "responses": ResponsesRequest,
    }[api]


def convert_request(api: str, body: Any, opts: dict):
    """Parse and convert a request the way the corpus generator handed it to the reference."""
    import json

    text = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return request_class(api)(text).convert(conversion_options(opts))


def golden_dir():
    """The golden corpus directory: $DEEPINFER_RECIPE_GOLDEN, else the package's own `tests/golden`."""
    import os
    from pathlib import Path

    env = os.environ.get("DEEPINFER_RECIPE_GOLDEN")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "golden"


def golden_cases(name: str) -> list[dict]:
    """The cases of one golden JSONL file (`name` or `name.xz`); a missing corpus is an error, not a skip."""
    import json
    import lzma

    d = golden_dir()
    for path, opener in ((d / name, open), (d / f"{name}.xz", lzma.open)):
        if path.is_file():
            with opener(path, "rt", encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
    raise FileNotFoundError(f"golden corpus {name} not found in {d} (set DEEPINFER_RECIPE_GOLDEN)")


def golden_params(name: str) -> list:
    """`pytest.param`s (id = case id) of one golden JSONL file for `parametrize`; one skipped param when the
    corpus is absent. Needs pytest (imported here, so the library itself does not depend on it)."""
    import pytest

    return [pytest.param(c, id=c["id"]) for c in golden_cases(name)]


def drive_stream(
    api, converted, chunks, *, tokenizer, call_finish, model, response_id="resp-golden", created=1700000000
):
    """Feed corpus chunks to a stream processor the way the golden driver did; normalized output."""
    from deepseek_recipe.parsing.stream_processor import (
        InferenceChunk,
        InferenceFinishReason,
        PromptUsage,
        StreamProcessor,
    )
    from deepseek_recipe.responses import response_class

    gen = request_class(api).chunk_generator(converted, response_id, model)
    gen._clock = lambda: created
    processor = StreamProcessor(gen, converted.parsing_options, tokenizer)
    resp_cls = response_class(api)
    ready = next((c for c in chunks if c["kind"] == "ready"), None)
    response = resp_cls(
        response_id,
        model,
        created,
        ready["prompt_tokens"] if ready else 0,
        ready["prompt_cache_hit_tokens"] if ready else 0,
    )
    stream: list = []
    pushed = 0
    error = None

    def take(events):
        for ev in events:
            # Name and serialize before accumulating: accumulate() consumes the chunk.
            stream.append({"event": resp_cls.sse_event_name(ev), "data": normalize(ev.to_dict())})
            response.accumulate(ev)

    try:
        for c in chunks:
            if processor.finished:
                break
            kind = c["kind"]
            if kind == "ready":
                chunk = InferenceChunk.ready(
                    prompt_usage=PromptUsage(
                        prompt_tokens=c["prompt_tokens"], prompt_cache_hit_tokens=c["prompt_cache_hit_tokens"]
                    ),
                    system_fingerprint=c.get("system_fingerprint"),
                )
            elif kind == "text":
                chunk = InferenceChunk.text(c["content"], c.get("token_count", 0))
            elif kind == "tokens":
                chunk = InferenceChunk.tokens(c["token_ids"])
            else:
                chunk = InferenceChunk.finish(getattr(InferenceFinishReason, c["finish_reason"]))
            pushed += 1
            take(processor.push(chunk))
        if call_finish:
            take(processor.finish())
    except RuntimeError as exc:
        error = exc
    return {
        "stream": stream,
        "response": normalize(response.to_dict()),
        "chunks_pushed": pushed,
        "finished": processor.finished,
        "error_exc": error,
        "sse_done_data": resp_cls.sse_done_data(),
    }


def normalize(value):
    """Corpus normalization: timestamps → 1700000000, generated tool-call ids → call_NN_<ID>."""
    import re

    pattern = re.compile(r"^call_(\d\d)_(ET_)?[A-Za-z0-9]{20}\d{4}$")
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in ("created", "created_at", "completed_at") and type(v) is int:
                out[k] = 1700000000
            else:
                out[k] = normalize(v)
        return out
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, str):
        m = pattern.match(value)
        if m:
            return f"call_{m.group(1)}_{m.group(2) or ''}<ID>"
    return value
