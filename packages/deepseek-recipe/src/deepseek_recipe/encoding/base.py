"""Shared pieces of the V4 and V4.1 prompt encodings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _json
from ..messages import (
    AssistantMessage,
    Conversation,
    ImageSource,
    LatestReminderMessage,
    Message,
    SystemMessage,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from .prompt import Prompt
from .special_tokens import DEFAULT_SPECIAL_TOKENS, SpecialToken, SpecialTokens

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

__all__ = ["RenderedPrompt", "WorkMessage", "EncodingBase"]

# Grounding tokens: the only special spellings honoured inside assistant content and
# reasoning (leftmost-first, in this pattern order).
_ASSISTANT_SPECIALS = (
    SpecialToken.Ref,
    SpecialToken.RefEnd,
    SpecialToken.Box,
    SpecialToken.BoxEnd,
    SpecialToken.Point,
    SpecialToken.PointEnd,
    SpecialToken.Polygon,
    SpecialToken.PolygonEnd,
)


class RenderedPrompt:
    """A rendered prompt: text, explicit special-token ranges (code points) and image sources."""

    __slots__ = ("_prompt", "_special_ranges", "_image_sources")

    def __init__(
        self, prompt: str, special_ranges: list[tuple[int, int]], image_sources: list[ImageSource]
    ) -> None:
        self._prompt = prompt
        self._special_ranges = special_ranges
        self._image_sources = image_sources

    prompt = property(lambda self: self._prompt)
    special_ranges = property(lambda self: list(self._special_ranges))
    image_sources = property(lambda self: list(self._image_sources))

    def __repr__(self) -> str:
        return f"RenderedPrompt({len(self._prompt)} chars, {len(self._special_ranges)} special ranges)"


@dataclass
class WorkMessage:
    """A message as the renderers manipulate it (content is a `Prompt` for system/user/tool)."""

    role: str
    content: Any
    reasoning_content: str | None = None
    tool_calls: list | None = None
    prefix: bool = False
    tool_call_id: str | None = None
    image_sources: list = field(default_factory=list)
    tools: list | None = None


def to_work(message: Message) -> WorkMessage:
    if isinstance(message, SystemMessage):
        return WorkMessage(
            "system", message._prompt.copy(), image_sources=list(message._image_sources), tools=message._tools
        )
    if isinstance(message, UserMessage):
        return WorkMessage("user", message._prompt.copy(), image_sources=list(message._image_sources))
    if isinstance(message, ToolMessage):
        return WorkMessage(
            "tool",
            message._prompt.copy(),
            image_sources=list(message._image_sources),
            tool_call_id=message._tool_call_id,
        )
    if isinstance(message, AssistantMessage):
        return WorkMessage(
            "assistant",
            message._content,
            reasoning_content=message._reasoning_content,
            tool_calls=None if message._tool_calls is None else list(message._tool_calls),
            prefix=message._prefix,
        )
    if isinstance(message, LatestReminderMessage):
        return WorkMessage("latest_reminder", message._content)
    raise TypeError(f"unsupported message type {type(message).__name__}")


def parse_tool_call_arguments(arguments: str) -> dict:
    """Arguments as the object whose entries become DSML parameters (else one `arguments` string)."""
    try:
        value = _json.loads(arguments)
    except ValueError:
        value = None
    if type(value) is dict:
        return value
    return {"arguments": arguments}


def tool_definition_json(tool: ToolDefinition) -> dict:
    return {"name": tool._name, "description": tool._description or "", "parameters": tool._parameters}


def renders_tool_prompt(conversation: Conversation) -> bool:
    return conversation._tool_choice != "none" and bool(conversation._tools)


def is_prefix_continuation(messages: list[WorkMessage]) -> bool:
    return bool(messages) and messages[-1].role == "assistant" and messages[-1].prefix


def tool_call_instructions(tokens: SpecialTokens, block: str, call: str, param: str) -> Prompt:
    d = tokens.dsml
    ts, te = tokens.thinking_start, tokens.thinking_end
    p = Prompt()
    P, S = p.push_plain, p.push_special
    P(
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. "
        'You can invoke tools by writing a "<'
    )
    S(d)
    P(f'{block}>" block like the following:\n\n<')
    S(d)
    P(f"{block}>\n<")
    S(d)
    P(f'{call} name="$TOOL_NAME">\n<')
    S(d)
    P(f'{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</')
    S(d)
    P(f"{param}>\n...\n</")
    S(d)
    P(f"{call}>\n<")
    S(d)
    P(f'{call} name="$TOOL_NAME2">\n...\n</')
    S(d)
    P(f"{call}>\n</")
    S(d)
    P(
        f'{block}>\n\nString parameters should be specified as is and set `string="true"`. For all other types '
        '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        "If thinking_mode is enabled (triggered by "
    )
    S(ts)
    P("), you MUST output your complete reasoning inside ")
    S(ts)
    P("...")
    S(te)
    P(" BEFORE any tool calls or final response.\n\nOtherwise, output directly after ")
    S(te)
    P(" with tool calls or final response.\n\n### Available Tool Schemas\n\n")
    return p


class EncodingBase:
    """Tokenizer + special-token mapping shared by both encodings."""

    __slots__ = ("_tokenizer", "_tokens", "_assistant_specials")

    def __init__(self) -> None:
        self._tokenizer: Tokenizer | None = None
        self._set_tokens(DEFAULT_SPECIAL_TOKENS)

    def _set_tokens(self, tokens: SpecialTokens) -> None:
        self._tokens = tokens
        self._assistant_specials = [tokens.token(t) for t in _ASSISTANT_SPECIALS]

    def _clone(self):
        other = type(self).__new__(type(self))
        other._tokenizer = self._tokenizer
        other._tokens = self._tokens
        other._assistant_specials = self._assistant_specials
        return other

    def with_tokenizer(self, tokenizer: Tokenizer):
        """Return a new prompt encoding that uses `tokenizer` for `encode`."""
        from ..tokenizer import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a deepseek_recipe.Tokenizer, got {type(tokenizer).__name__}")
        other = self._clone()
        other._tokenizer = tokenizer
        return other

    def with_special_tokens(self, special_tokens: SpecialTokens):
        """Return a new prompt encoding that renders prompts with `special_tokens`."""
        if not isinstance(special_tokens, SpecialTokens):
            raise TypeError(f"special_tokens must be SpecialTokens, got {type(special_tokens).__name__}")
        other = self._clone()
        other._set_tokens(special_tokens)
        return other

    def _push_assistant_content(self, prompt: Prompt, content: str) -> None:
        """Assistant content/reasoning: grounding tokens special, everything else plain."""
        specials = self._assistant_specials
        if "<" not in content:
            prompt.push_plain(content)
            return
        cursor = 0
        n = len(content)
        while cursor < n:
            best = -1
            best_tok = ""
            for tok in specials:  # leftmost match; ties go to the earlier pattern
                at = content.find(tok, cursor, best if best >= 0 else n)
                if at >= 0 and (best < 0 or at < best):
                    best, best_tok = at, tok
            if best < 0:
                break
            prompt.push_plain(content[cursor:best])
            prompt.push_special(best_tok)
            cursor = best + len(best_tok)
        prompt.push_plain(content[cursor:])

    def _push_generation_start(
        self, p: Prompt, messages: list[WorkMessage], conversation: Conversation, tool_prompt: bool, block: str
    ) -> None:
        """The prompt tail: open the assistant turn (unless a prefix continues it) and, with
        `tool_choice == "required"`, the tool-call block (`block`: its DSML name, e.g. "tool_calls")."""
        tk = self._tokens
        if not is_prefix_continuation(messages):
            p.push_special(tk.assistant)
            p.push_special(tk.thinking_start if conversation._thinking_mode else tk.thinking_end)
        if conversation._tool_choice == "required" and tool_prompt:
            p.push_plain("\n\n<")
            p.push_special(tk.dsml)
            p.push_plain(f"{block}>\n")

    def render_conversation(self, conversation: Conversation) -> RenderedPrompt:
        if not isinstance(conversation, Conversation):
            raise TypeError(f"conversation must be a Conversation, got {type(conversation).__name__}")
        prompt, messages = self._render(conversation)
        text, ranges = prompt.finish()
        sources: list[ImageSource] = []
        for m in messages:
            if m.role in ("system", "user", "tool"):
                sources.extend(m.image_sources)
        return RenderedPrompt(text, ranges, sources)

    def _render(self, conversation: Conversation) -> tuple[Prompt, list[WorkMessage]]:  # pragma: no cover
        raise NotImplementedError

    def encode(self, conversation: Conversation) -> list[int]:
        """Encode a conversation into token ids with the attached tokenizer (RuntimeError on failure)."""
        if self._tokenizer is None:
            raise RuntimeError("failed to encode conversation: no tokenizer is attached")
        rendered = self.render_conversation(conversation)
        return self._tokenizer.encode_prompt(rendered.prompt, rendered._special_ranges)
