"""`DeepseekV41Encoding`: the V4.1 prompt layout (docs/recipe.md §5)."""

from __future__ import annotations

from .. import _json
from ..messages import Conversation, ToolCall
from .base import (
    EncodingBase,
    WorkMessage,
    parse_tool_call_arguments,
    renders_tool_prompt,
    to_work,
    tool_call_instructions,
    tool_definition_json,
)
from .prompt import Prompt

__all__ = ["DeepseekV41Encoding"]

_EFFORT_SCORE = {"low": "50", None: "75", "high": "75", "xhigh": "75", "max": "100"}


def _normalize(messages: list[WorkMessage]) -> list[WorkMessage]:
    out: list[WorkMessage] = []
    for m in messages:
        if out and m.role == "user" and out[-1].role == "user":
            prev = out[-1]
            # Unlike V4, empty contents are not skipped.
            prev.content.push_plain("\n\n")
            prev.content.extend(m.content)
            prev.image_sources = prev.image_sources + m.image_sources
            continue
        if out and m.role == "latest_reminder" and out[-1].role == "latest_reminder":
            continue  # a reminder right after a reminder is dropped
        out.append(m)
    _sort_tool_results(out)
    return out


def _sort_tool_results(messages: list[WorkMessage]) -> None:
    order: list[str] = []
    i, n = 0, len(messages)
    while i < n:
        m = messages[i]
        if m.role == "assistant" and m.tool_calls:
            order = [c._id for c in m.tool_calls]
            i += 1
        elif m.role in ("user", "tool"):
            start = i
            while i < n and messages[i].role in ("user", "tool"):
                i += 1
            slots = [
                j
                for j in range(start, i)
                if messages[j].role == "tool" and messages[j].tool_call_id is not None
            ]
            if len(slots) > 1 and order:

                def key(msg: WorkMessage, order: list[str] = order) -> int:
                    try:
                        return order.index(msg.tool_call_id)
                    except ValueError:
                        return 0

                results = sorted((messages[j] for j in slots), key=key)
                for j, msg in zip(slots, results):
                    messages[j] = msg
        else:
            i += 1


class DeepseekV41Encoding(EncodingBase):
    """The V4.1 prompt encoding: renders a conversation and, with a tokenizer, encodes it."""

    __slots__ = ()

    def _tool_prompt(self, tools) -> Prompt:
        schemas = "\n".join(
            _json.dumps_python_style(tool_definition_json(t)) for t in tools if not t._defer_loading
        )
        p = tool_call_instructions(self._tokens, " calls", " invoke", " parameter")
        p.push_plain(schemas)
        p.push_plain(
            "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
        )
        return p

    def _tool_calls(self, tool_calls: list[ToolCall]) -> Prompt:
        d = self._tokens.dsml
        p = Prompt()
        p.push_plain("\n\n<")
        p.push_special(d)
        p.push_plain(" calls>\n")
        for index, call in enumerate(tool_calls):
            if index:
                p.push_plain("\n")
            p.push_plain("<")
            p.push_special(d)
            p.push_plain(f' invoke name="{call._name}">\n')
            for k, (key, value) in enumerate(parse_tool_call_arguments(call._arguments).items()):
                if type(value) is str:
                    is_str, text = "true", value
                else:
                    is_str, text = "false", _json.dumps_python_style(value)
                if k:
                    p.push_plain("\n")
                p.push_plain("<")
                p.push_special(d)
                p.push_plain(f' parameter name="{key}" string="{is_str}">{text}</')
                p.push_special(d)
                p.push_plain(" parameter>")
            p.push_plain("\n</")
            p.push_special(d)
            p.push_plain(" invoke>")
        p.push_plain("\n</")
        p.push_special(d)
        p.push_plain(" calls>")
        return p

    def _render(self, conversation: Conversation) -> tuple[Prompt, list[WorkMessage]]:
        tk = self._tokens
        messages = _normalize([to_work(m) for m in conversation._messages])
        tool_prompt = renders_tool_prompt(conversation)
        fmt = conversation._response_format
        schema = None
        if fmt == "json_object":
            schema = {"type": "json_object"}
        elif fmt == "json_schema":
            schema = conversation._response_schema
        if tool_prompt or fmt in ("json_object", "json_schema"):
            if not messages or messages[0].role != "system":
                messages.insert(0, WorkMessage("system", Prompt()))
            first = messages[0]
            content = first.content.copy()
            if tool_prompt:
                content.push_plain("\n\n")
                content.extend(self._tool_prompt(conversation._tools))
            if fmt in ("json_object", "json_schema"):
                content.push_plain(
                    "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                    + _json.dumps_python_style(schema)
                )
            first.content = content
        drop_thinking = not tool_prompt
        thinking = conversation._thinking_mode
        effort = conversation._reasoning_effort

        p = Prompt()
        p.push_special(tk.bos)
        prev = None
        for index, m in enumerate(messages):
            role = m.role
            if index == 0 and (thinking or role == "system"):
                # [I] docs/recipe.md §1: `<｜System｜>` exists only in the (unpublished) V4.1 tokenizer; with the
                # public V4 tokenizer, encoding such a prompt fails exactly as the reference does.
                p.push_special(tk.system)
            if index == 0 and thinking:
                p.push_plain(
                    f"Reasoning Effort: {_EFFORT_SCORE[effort]} (range 1-100, the higher the value, "
                    "the more thorough the reasoning)\n\n"
                )
            if role == "system":
                if index > 0:
                    p.push_special(tk.system)
                p.extend(m.content)
                if m.tools:
                    schemas = "\n".join(_json.dumps_python_style(tool_definition_json(t)) for t in m.tools)
                    p.push_plain(f"\n\n### Updated Tool Schemas\n\n{schemas}")
            elif role in ("user", "tool"):
                if prev in ("user", "tool"):
                    p.push_plain("\n\n")
                else:
                    p.push_special(tk.user)
                if role == "user":
                    p.extend(m.content)
                else:
                    p.push_plain("<tool_result>")
                    p.extend(m.content)
                    p.push_plain("</tool_result>")
            elif role == "latest_reminder":
                p.push_special(tk.latest_reminder)
                p.push_plain(m.content)
            else:  # assistant
                calls = self._tool_calls(m.tool_calls) if m.tool_calls else Prompt()
                renders_reasoning = thinking and index > 0 and (not drop_thinking or m.prefix)
                block = Prompt()
                if renders_reasoning:
                    if m.reasoning_content is not None:
                        self._push_assistant_content(block, m.reasoning_content)
                    if not (m.prefix and not m.content and not calls.parts):
                        block.push_special(tk.thinking_end)
                p.push_special(tk.assistant)
                if not block.is_empty() or (renders_reasoning and m.prefix):
                    p.push_special(tk.thinking_start)
                else:
                    p.push_special(tk.thinking_end)
                p.extend(block)
                self._push_assistant_content(p, m.content)
                p.extend(calls)
                if not m.prefix:
                    p.push_special(tk.eos)
            prev = role
        self._push_generation_start(p, messages, conversation, tool_prompt, " calls")
        return p, messages
