"""`DeepseekV4Encoding`: the V4 prompt layout (docs/recipe.md §4)."""

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

__all__ = ["DeepseekV4Encoding"]

REASONING_EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
JSON_OBJECT_SYSTEM_PROMPT = "You are a helpful assistant designed to output JSON.\n## Response Format:\n\nReply with JSON object ONLY."


def _normalize(messages: list[WorkMessage]) -> list[WorkMessage]:
    systems: list[WorkMessage] = []
    others: list[WorkMessage] = []
    for m in messages:
        if m.role == "system":
            # Non-empty system messages are hoisted; their `tools` are ignored by V4.
            if not m.content.is_empty():
                systems.append(WorkMessage("system", m.content, image_sources=m.image_sources))
            continue
        if m.role == "user" and others and others[-1].role == "user":
            prev = others[-1]
            if not m.content.is_empty():
                if not prev.content.is_empty():
                    prev.content.push_plain("\n\n")
                prev.content.extend(m.content)
            prev.image_sources = prev.image_sources + m.image_sources
            continue
        others.append(m)
    ranges = []
    for i, m in enumerate(others):
        if m.role == "assistant" and m.tool_calls is not None:
            m.tool_calls = sorted(m.tool_calls, key=lambda c: c._id)
            if m.tool_calls:
                ranges.append((i + 1, i + 1 + len(m.tool_calls)))
    for start, end in ranges:
        if end > len(others):
            continue

        def key(msg: WorkMessage):
            if msg.role == "tool":
                # None sorts before any id (Rust Option ordering).
                return (False, msg.tool_call_id is not None, msg.tool_call_id or "")
            return (True, False, "")

        others[start:end] = sorted(others[start:end], key=key)
    return systems + others


class DeepseekV4Encoding(EncodingBase):
    """The V4 prompt encoding: renders a conversation and, with a tokenizer, encodes it."""

    __slots__ = ()

    def _tool_prompt(self, tools) -> Prompt:
        p = tool_call_instructions(self._tokens, "tool_calls", "invoke", "parameter")
        for tool in tools:
            if not tool._defer_loading:
                p.push_plain(_json.dumps_spaced(tool_definition_json(tool)))
                p.push_plain("\n")
        p.push_plain(
            "\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
        )
        return p

    def _push_tool_calls(self, p: Prompt, tool_calls: list[ToolCall]) -> None:
        d = self._tokens.dsml
        p.push_plain("\n\n<")
        p.push_special(d)
        p.push_plain("tool_calls>\n")
        for call in tool_calls:
            p.push_plain("<")
            p.push_special(d)
            p.push_plain(f'invoke name="{call._name}">\n')
            for key, value in parse_tool_call_arguments(call._arguments).items():
                if type(value) is str:
                    is_str, text = "true", value
                else:
                    is_str, text = "false", _json.dumps_spaced(value)
                p.push_plain("<")
                p.push_special(d)
                p.push_plain(f'parameter name="{key}" string="{is_str}">{text}</')
                p.push_special(d)
                p.push_plain("parameter>\n")
            p.push_plain("</")
            p.push_special(d)
            p.push_plain("invoke>\n")
        p.push_plain("</")
        p.push_special(d)
        p.push_plain("tool_calls>")

    def _render(self, conversation: Conversation) -> tuple[Prompt, list[WorkMessage]]:
        tk = self._tokens
        messages = _normalize([to_work(m) for m in conversation._messages])
        tool_prompt = renders_tool_prompt(conversation)
        extra: list[Prompt] = []
        if tool_prompt:
            extra.append(self._tool_prompt(conversation._tools))
        fmt = conversation._response_format
        if fmt == "json_object":
            extra.append(Prompt.plain(JSON_OBJECT_SYSTEM_PROMPT))
        elif fmt == "json_schema":
            extra.append(
                Prompt.plain(
                    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                    + _json.dumps_spaced(conversation._response_schema)
                )
            )
        if extra:
            index = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
            if index == 0:
                messages.insert(0, WorkMessage("system", Prompt()))
                index = 1
            for content in extra:
                messages.insert(index, WorkMessage("system", content))
                index += 1
        drop_thinking = not tool_prompt
        thinking = conversation._thinking_mode

        p = Prompt()
        p.push_special(tk.bos)
        if thinking:
            effort = conversation._reasoning_effort
            if effort == "max":
                p.push_plain(REASONING_EFFORT_MAX)
            elif effort != "low":
                p.push_plain(REASONING_EFFORT_HIGH)
        has_system = False
        prev = None
        last = len(messages) - 1
        for index, m in enumerate(messages):
            role = m.role
            if role == "system":
                if has_system:
                    p.push_plain("\n\n")
                p.extend(m.content)
                has_system = True
            elif role == "user":
                if prev in ("user", "tool"):
                    p.push_plain("\n\n")
                else:
                    p.push_special(tk.user)
                p.extend(m.content)
            elif role == "assistant":
                p.push_special(tk.assistant)
                if m.reasoning_content is not None and (m.prefix or not drop_thinking):
                    p.push_special(tk.thinking_start)
                    self._push_assistant_content(p, m.reasoning_content)
                if not thinking or not m.prefix or m.content:
                    p.push_special(tk.thinking_end)
                self._push_assistant_content(p, m.content)
                if m.tool_calls is not None:
                    self._push_tool_calls(p, m.tool_calls)
                if index < last or not m.prefix:
                    p.push_special(tk.eos)
            elif role == "tool":
                if prev == "tool":
                    p.push_plain("\n\n")
                else:
                    p.push_special(tk.user)
                p.push_plain("<tool_result>")
                p.extend(m.content)
                p.push_plain("</tool_result>")
            else:  # latest_reminder
                p.push_special(tk.latest_reminder)
                p.push_plain(m.content)
            prev = role
        self._push_generation_start(p, messages, conversation, tool_prompt, "tool_calls")
        return p, messages
