"""Conversation model: messages, tool calls, tool definitions, image sources, `Conversation`."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from typing import Any

from . import _json
from ._text import check_opt_text, check_text
from .encoding.prompt import Prompt
from .encoding.special_tokens import SpecialToken

__all__ = [
    "ToolCall",
    "ToolDefinition",
    "ImageSource",
    "DataUrlImageSource",
    "UrlImageSource",
    "BytesImageSource",
    "Message",
    "SystemMessage",
    "UserMessage",
    "AssistantMessage",
    "ToolMessage",
    "LatestReminderMessage",
    "Conversation",
]

_DETAILS = ("low", "high", "original", "auto")


def _check_detail(detail: str) -> str:
    detail = check_text(detail, "image detail")
    if detail not in _DETAILS:
        raise ValueError(f'invalid detail "{detail}"; expected "low", "high", "original", or "auto"')
    return detail


class ToolCall:
    """A historical tool call; `arguments` is expected to encode a JSON object (not validated)."""

    __slots__ = ("_id", "_name", "_arguments")

    def __init__(self, id: str, name: str, arguments: str) -> None:  # noqa: A002 - official name
        self._id = check_text(id, "ToolCall.id")
        self._name = check_text(name, "ToolCall.name")
        self._arguments = check_text(arguments, "ToolCall.arguments")

    id = property(lambda self: self._id)
    name = property(lambda self: self._name)
    arguments = property(lambda self: self._arguments)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolCall) and (self._id, self._name, self._arguments) == (
            other._id,
            other._name,
            other._arguments,
        )

    def __repr__(self) -> str:
        return f"ToolCall(id={self._id!r}, name={self._name!r}, arguments={self._arguments!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self._id, "name": self._name, "arguments": self._arguments}


class ToolDefinition:
    """A client tool definition; direct construction does not normalize `parameters`."""

    __slots__ = ("_name", "_description", "_parameters", "_strict", "_defer_loading")

    def __init__(
        self,
        name: str,
        description: str | None = None,
        parameters: Any = None,
        strict: bool | None = None,
        defer_loading: bool = False,
    ) -> None:
        self._name = check_text(name, "ToolDefinition.name")
        self._description = check_opt_text(description, "ToolDefinition.description")
        try:
            self._parameters = _json.from_python(parameters)
        except _json.JSONError as exc:
            raise ValueError(f"ToolDefinition.parameters: {exc}") from None
        if strict is not None and not isinstance(strict, bool):
            raise TypeError(f"ToolDefinition.strict must be a bool or None, got {type(strict).__name__}")
        self._strict = strict
        self._defer_loading = bool(defer_loading)

    name = property(lambda self: self._name)
    description = property(lambda self: self._description)
    parameters = property(lambda self: copy.deepcopy(self._parameters))
    strict = property(lambda self: self._strict)
    defer_loading = property(lambda self: self._defer_loading)

    def __repr__(self) -> str:
        return f"ToolDefinition(name={self._name!r})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self._name,
            "description": self._description,
            "parameters": copy.deepcopy(self._parameters),
            "strict": self._strict,
            "defer_loading": self._defer_loading,
        }


class ImageSource:
    """Base class of image sources; `path` is the request location (e.g. `messages.0.content[1]`)."""

    __slots__ = ("_kind", "_detail", "_path", "_url", "_data_url", "_data")

    def __init__(self) -> None:  # pragma: no cover - abstract
        raise TypeError("use DataUrlImageSource, UrlImageSource or BytesImageSource")

    kind = property(lambda self: self._kind)
    detail = property(lambda self: self._detail)
    path = property(lambda self: self._path)
    url = property(lambda self: self._url)
    data_url = property(lambda self: self._data_url)
    data = property(lambda self: self._data)

    def _init(self, kind, detail, path, url=None, data_url=None, data=None) -> None:
        name = type(self).__name__
        path = check_text(path, f"{name}.path")
        url = check_opt_text(url, f"{name}.url")
        data_url = check_opt_text(data_url, f"{name}.data_url")
        self._kind, self._detail, self._path = kind, _check_detail(detail), path
        self._url, self._data_url, self._data = url, data_url, data

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self._kind,
            "detail": self._detail,
            "path": self._path,
            "url": self._url,
            "data_url_sha256": (
                hashlib.sha256(self._data_url.encode()).hexdigest() if self._data_url is not None else None
            ),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self._kind!r}, detail={self._detail!r}, path={self._path!r})"


class DataUrlImageSource(ImageSource):
    """An image referenced by a data URL."""

    __slots__ = ()

    def __init__(self, data_url: str, detail: str = "high", *, path: str = "") -> None:
        self._init("data_url", detail, path, data_url=check_text(data_url, "DataUrlImageSource.data_url"))


class UrlImageSource(ImageSource):
    """An image referenced by an external URL."""

    __slots__ = ()

    def __init__(self, url: str, detail: str = "high", *, path: str = "") -> None:
        self._init("url", detail, path, url=check_text(url, "UrlImageSource.url"))


class BytesImageSource(ImageSource):
    """An image supplied as encoded bytes."""

    __slots__ = ()

    def __init__(self, data: bytes, detail: str = "high", *, path: str = "") -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"BytesImageSource.data must be bytes, got {type(data).__name__}")
        self._init("bytes", detail, path, data=bytes(data))


def _content_with_placeholders(text: str, image_count: int, image_token: str | None) -> Prompt:
    placeholder = SpecialToken.Image.value if image_token is None else check_text(image_token, "image_token")
    if not placeholder:
        raise ValueError("image_token must not be empty")
    content = Prompt()
    cursor = 0
    for _ in range(image_count):
        start = text.find(placeholder, cursor)
        if start < 0:
            break
        content.push_plain(text[cursor:start])
        content.push_special(placeholder)
        cursor = start + len(placeholder)
    content.push_plain(text[cursor:])
    return content


class Message:
    """Base class of conversation messages; role-specific properties have fixed values elsewhere."""

    __slots__ = ()
    role: str = ""

    @property
    def content(self) -> str:
        return self._content  # type: ignore[attr-defined]

    reasoning_content = property(lambda self: None)
    tool_calls = property(lambda self: None)
    tool_call_id = property(lambda self: None)
    prefix = property(lambda self: False)

    @property
    def image_sources(self) -> list[ImageSource]:
        return []

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - overridden
        raise NotImplementedError


class _ContentMessage(Message):
    """A message whose content may hold image placeholders (system, user, tool)."""

    __slots__ = ("_content", "_prompt", "_image_sources")

    def _set_content(self, content: str, image_sources, image_token) -> None:
        content = check_text(content, f"{type(self).__name__}.content")
        sources = list(image_sources or ())
        for s in sources:
            if not isinstance(s, ImageSource):
                raise TypeError(f"image_sources must hold ImageSource objects, got {type(s).__name__}")
        self._prompt = _content_with_placeholders(content, len(sources), image_token)
        self._content = content
        self._image_sources = sources

    @classmethod
    def _from_prompt(cls, prompt: Prompt, image_sources: list[ImageSource], **extra: Any):
        self = cls.__new__(cls)
        self._prompt = prompt
        self._content = prompt.text()
        self._image_sources = list(image_sources)
        for name, value in extra.items():
            setattr(self, name, value)
        return self

    @property
    def image_sources(self) -> list[ImageSource]:
        return list(self._image_sources)


class SystemMessage(_ContentMessage):
    """A system message (optionally introducing `tools` mid-conversation)."""

    __slots__ = ("_tools",)
    role = "system"

    def __init__(
        self,
        content: str,
        image_sources=None,
        tools: Sequence[ToolDefinition] | None = None,
        *,
        image_token=None,
    ) -> None:
        self._set_content(content, image_sources, image_token)
        self._tools = None if tools is None else _tool_list(tools, "SystemMessage.tools")

    @property
    def tools(self) -> list[ToolDefinition] | None:
        return None if self._tools is None else list(self._tools)

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": "system",
            "content": self._content,
            "image_sources": [s.to_dict() for s in self._image_sources],
            "tools": None if self._tools is None else [t.to_dict() for t in self._tools],
        }

    def __repr__(self) -> str:
        return f"SystemMessage({self._content!r})"


class UserMessage(_ContentMessage):
    """A user message; the first occurrences of `image_token` become image placeholders."""

    __slots__ = ()
    role = "user"

    def __init__(self, content: str, image_sources=None, *, image_token=None) -> None:
        self._set_content(content, image_sources, image_token)

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": "user",
            "content": self._content,
            "image_sources": [s.to_dict() for s in self._image_sources],
        }

    def __repr__(self) -> str:
        return f"UserMessage({self._content!r})"


class ToolMessage(_ContentMessage):
    """A tool result message."""

    __slots__ = ("_tool_call_id",)
    role = "tool"

    def __init__(
        self, content: str, tool_call_id: str | None = None, image_sources=None, *, image_token=None
    ) -> None:
        self._set_content(content, image_sources, image_token)
        self._tool_call_id = check_opt_text(tool_call_id, "ToolMessage.tool_call_id")

    tool_call_id = property(lambda self: self._tool_call_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": "tool",
            "content": self._content,
            "tool_call_id": self._tool_call_id,
            "image_sources": [s.to_dict() for s in self._image_sources],
        }

    def __repr__(self) -> str:
        return f"ToolMessage({self._content!r}, tool_call_id={self._tool_call_id!r})"


class AssistantMessage(Message):
    """An assistant message (history, or a `prefix` to continue)."""

    __slots__ = ("_content", "_reasoning_content", "_tool_calls", "_prefix")
    role = "assistant"

    def __init__(
        self,
        content: str,
        reasoning_content: str | None = None,
        tool_calls: Sequence[ToolCall] | None = None,
        prefix: bool = False,
    ) -> None:
        self._content = check_text(content, "AssistantMessage.content")
        self._reasoning_content = check_opt_text(reasoning_content, "AssistantMessage.reasoning_content")
        if tool_calls is not None:
            tool_calls = list(tool_calls)
            for c in tool_calls:
                if not isinstance(c, ToolCall):
                    raise TypeError(f"tool_calls must hold ToolCall objects, got {type(c).__name__}")
        self._tool_calls = tool_calls
        self._prefix = bool(prefix)

    reasoning_content = property(lambda self: self._reasoning_content)
    tool_calls = property(lambda self: None if self._tool_calls is None else list(self._tool_calls))
    prefix = property(lambda self: self._prefix)

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": self._content,
            "reasoning_content": self._reasoning_content,
            "tool_calls": None if self._tool_calls is None else [c.to_dict() for c in self._tool_calls],
            "prefix": self._prefix,
        }

    def __repr__(self) -> str:
        return f"AssistantMessage({self._content!r}, prefix={self._prefix})"


class LatestReminderMessage(Message):
    """A reminder carrying additional instructions, rendered after `<｜latest_reminder｜>`."""

    __slots__ = ("_content",)
    role = "latest_reminder"

    def __init__(self, content: str) -> None:
        self._content = check_text(content, "LatestReminderMessage.content")

    def to_dict(self) -> dict[str, Any]:
        return {"role": "latest_reminder", "content": self._content}

    def __repr__(self) -> str:
        return f"LatestReminderMessage({self._content!r})"


def _tool_list(tools, where: str) -> list[ToolDefinition]:
    out = list(tools)
    for t in out:
        if not isinstance(t, ToolDefinition):
            raise TypeError(f"{where} must hold ToolDefinition objects, got {type(t).__name__}")
    return out


_TOOL_CHOICES = ("auto", "none", "required")
_EFFORTS = ("low", "high", "xhigh", "max")


class Conversation:
    """A conversation and its prompt configuration (thinking on, tool choice `auto`, format `text`)."""

    __slots__ = (
        "_messages",
        "_thinking_mode",
        "_tools",
        "_tool_choice",
        "_reasoning_effort",
        "_response_format",
        "_response_schema",
        "_response_regex",
    )

    def __init__(
        self,
        messages: Sequence[Message] | None = None,
        *,
        thinking_mode: bool = True,
        tools: Sequence[ToolDefinition] | None = None,
        tool_choice: str = "auto",
        reasoning_effort: str | None = None,
        response_format: str = "text",
        response_schema: Any | None = None,
        response_regex: str | None = None,
    ) -> None:
        for name, value in (
            ("tool_choice", tool_choice),
            ("reasoning_effort", reasoning_effort),
            ("response_format", response_format),
            ("response_regex", response_regex),
        ):
            check_opt_text(value, f"Conversation.{name}")
        if tool_choice not in _TOOL_CHOICES:
            raise ValueError(f'invalid tool_choice "{tool_choice}"; expected "auto", "none", or "required"')
        if reasoning_effort is not None and reasoning_effort not in _EFFORTS:
            raise ValueError(
                f'invalid reasoning_effort "{reasoning_effort}"; expected "low", "high", "xhigh", or "max"'
            )
        if response_format not in ("text", "json_object"):
            raise ValueError(f'invalid response_format "{response_format}"; expected "text" or "json_object"')
        if response_schema is not None and response_regex is not None:
            raise ValueError("response_schema and response_regex cannot be combined")
        if response_format != "text" and (response_schema is not None or response_regex is not None):
            raise ValueError(
                f'response_format "{response_format}" cannot be combined with response_schema or response_regex'
            )
        msgs = list(messages or ())
        for m in msgs:
            # The concrete kinds only: the renderers know no other (a bare `Message` subclass has no content).
            if not isinstance(m, (SystemMessage, UserMessage, AssistantMessage, ToolMessage, LatestReminderMessage)):
                raise TypeError(f"messages must hold Message objects, got {type(m).__name__}")
        self._messages = msgs
        self._thinking_mode = bool(thinking_mode)
        self._tools = _tool_list(tools or (), "Conversation.tools")
        self._tool_choice = tool_choice
        self._reasoning_effort = reasoning_effort
        if response_schema is not None:
            self._response_format = "json_schema"
        elif response_regex is not None:
            self._response_format = "regex"
        else:
            self._response_format = response_format
        try:
            self._response_schema = None if response_schema is None else _json.from_python(response_schema)
        except _json.JSONError as exc:
            raise ValueError(f"Conversation.response_schema: {exc}") from None
        self._response_regex = response_regex

    messages = property(lambda self: list(self._messages))
    thinking_mode = property(lambda self: self._thinking_mode)
    tools = property(lambda self: list(self._tools))
    tool_choice = property(lambda self: self._tool_choice)
    reasoning_effort = property(lambda self: self._reasoning_effort)
    response_format = property(lambda self: self._response_format)
    response_schema = property(lambda self: copy.deepcopy(self._response_schema))
    response_regex = property(lambda self: self._response_regex)

    def to_dict(self) -> dict[str, Any]:
        """The conversation as plain JSON-like data (the golden corpus's shape)."""
        return {
            "messages": [m.to_dict() for m in self._messages],
            "thinking_mode": self._thinking_mode,
            "tools": [t.to_dict() for t in self._tools],
            "tool_choice": self._tool_choice,
            "reasoning_effort": self._reasoning_effort,
            "response_format": self._response_format,
            "response_schema": copy.deepcopy(self._response_schema),
            "response_regex": self._response_regex,
        }

    def __repr__(self) -> str:
        return f"Conversation({len(self._messages)} messages, thinking_mode={self._thinking_mode})"
