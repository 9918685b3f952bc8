"""Conversion pieces shared by the three protocols, their request base class, and `ConversationRequest`."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _json
from .._text import describe
from ..encoding.prompt import Prompt
from ..errors import ConversionError
from ..messages import (
    AssistantMessage,
    Conversation,
    DataUrlImageSource,
    ImageSource,
    ToolDefinition,
    UserMessage,
)
from ..options import (
    ConversionOptions,
    InferenceOptions,
    ModelVersion,
    OutputConstraint,
    ParsingOptions,
    ThinkingInitialStage,
)
from ._schema_check import default_strict_schema, normalize_strict_schema, validate_schema
from ._serde import SchemaError, parse_body

__all__ = ["ConversationRequest", "ResponseOptions"]

MAX_TOOL_NAME_LEN = 128
MAX_STOP_SEQUENCES = 16
MAX_IMAGE_URL_LEN = 8192
UNSUPPORTED_IMAGE_PLACEHOLDER = "[Unsupported Image]"
UNSUPPORTED_DOCUMENT_PLACEHOLDER = "[Unsupported Document]"
UNSUPPORTED_IMAGE_ERROR_MESSAGE = (
    "You have uploaded an unsupported image. Please make sure your image is valid and has one of the "
    "following formats: webp, png, jpeg, and gif."
)
UNSUPPORTED_FILE_ERROR_MESSAGE = (
    "You have uploaded an unsupported file. Please make sure your file is valid and has one of the "
    "following formats: webp, png, jpeg, and gif."
)
DEFAULT_NON_THINKING_MAX_TOKENS = 8 * 1024
DEFAULT_THINKING_MAX_TOKENS = 64 * 1024
DEFAULT_MAX_EFFORT_MAX_TOKENS = 128 * 1024

EFFORT_MAP = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "xhigh",
    "ultra": "max",
    "max": "max",
}
REQUEST_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
IMAGE_DETAILS = ("low", "high", "original", "auto")


@dataclass
class ResponseOptions:
    include_usage: bool = False
    custom_tool_names: set = field(default_factory=set)
    client_tool_search: bool = False
    namespace_tool_map: dict | None = None
    responses_echo: Any = None


class ConversationRequest:
    """A converted request: conversation, inference options, parsing options, model version, stream."""

    def __init__(self, conversation: Conversation, model_version: ModelVersion) -> None:
        if not isinstance(conversation, Conversation):
            raise TypeError(f"conversation must be a Conversation, got {type(conversation).__name__}")
        if not isinstance(model_version, ModelVersion):
            raise TypeError(f"model_version must be a ModelVersion, got {describe(model_version)}")
        self._conversation = conversation
        self._inference_options = InferenceOptions()
        self._parsing_options = ParsingOptions()
        self._model_version = model_version
        self._stream = False
        self._response_options = ResponseOptions()

    @classmethod
    def _build(
        cls, conversation, inference_options, parsing_options, model_version, stream, response_options
    ):
        self = cls.__new__(cls)
        self._conversation = conversation
        self._inference_options = inference_options
        self._parsing_options = parsing_options
        self._model_version = model_version
        self._stream = stream
        self._response_options = response_options
        return self

    conversation = property(lambda self: self._conversation)
    inference_options = property(lambda self: self._inference_options)
    parsing_options = property(lambda self: self._parsing_options)
    model_version = property(lambda self: self._model_version)
    stream = property(lambda self: self._stream)

    def encoding(self):
        """The prompt encoding of this request's model version."""
        return self._model_version.encoding()

    def resolve_max_tokens(self, prompt_tokens: int, context_limit: int) -> int:
        """The `max_tokens` to send to the backend (ConversionError when the context is exceeded)."""
        for name, value in (("prompt_tokens", prompt_tokens), ("context_limit", context_limit)):
            if type(value) is not int or not 0 <= value < 2**32:
                raise ValueError(f"{name} must be an integer in [0, 2^32), got {describe(value)}")
        requested = self._inference_options.max_tokens or 0
        total = min(prompt_tokens + requested, 2**32 - 1)
        if total > context_limit:
            raise ConversionError(
                f"This model's maximum context length is {context_limit} tokens. However, you requested "
                f"{total} tokens ({prompt_tokens} in the messages, {requested} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        conv = self._conversation
        if not conv.thinking_mode:
            default = DEFAULT_NON_THINKING_MAX_TOKENS
        elif conv.reasoning_effort == "max":
            default = DEFAULT_MAX_EFFORT_MAX_TOKENS
        else:
            default = DEFAULT_THINKING_MAX_TOKENS
        mt = self._inference_options.max_tokens
        value = default if mt is None else mt
        return max(min(value, context_limit - prompt_tokens), 1)


class ProtocolRequest:
    """Base of the three protocol requests: the body is parsed once, and `convert` consumes it.

    A subclass sets `_parse_request` to its protocol's schema parser (value -> dict of fields, raising
    `SchemaError`).
    """

    _parse_request: Callable[[Any], dict]

    def __init__(self, body: Any) -> None:
        self._consumed = False
        value = parse_body(body)
        try:
            self._req = type(self)._parse_request(value)
        except SchemaError as exc:
            raise ValueError(f"invalid request body: {exc}") from None

    def _live(self) -> None:
        if self._consumed:
            raise RuntimeError(f"this {type(self).__name__} has been consumed by convert()")

    @property
    def model(self) -> str:
        """The requested model name; read it before `convert` consumes the request."""
        self._live()
        return self._req["model"]

    def _consume(self, options: ConversionOptions | None) -> ConversionOptions:
        """Check `options` (default: `ConversionOptions()`) and mark the request consumed."""
        options = ConversionOptions() if options is None else options
        if not isinstance(options, ConversionOptions):
            raise TypeError(f"options must be ConversionOptions, got {type(options).__name__}")
        self._live()
        self._consumed = True  # even a failed conversion consumes the request, as in the reference
        return options


def join_paragraphs(parts: list[Prompt]) -> Prompt:
    """The content parts of one message joined with a blank line between them."""
    out = Prompt()
    for i, p in enumerate(parts):
        if i:
            out.push_plain("\n\n")
        out.extend(p)
    return out


# -- thinking / effort ----------------------------------------------------------------------


def resolve_thinking_mode(
    default: bool, thinking_type: str | None, effort: str | None
) -> tuple[bool, str | None]:
    if thinking_type in ("enabled", "adaptive"):
        thinking = True
    elif thinking_type == "disabled":
        thinking = False
    elif effort == "none":
        thinking = False
    elif effort is not None:
        thinking = True
    else:
        thinking = default
    if not thinking:
        return False, None
    mapped = EFFORT_MAP.get(effort) if effort is not None else None
    return True, mapped or "high"


def thinking_initial_stage(messages: list) -> ThinkingInitialStage:
    last = messages[-1] if messages else None
    if isinstance(last, AssistantMessage) and last._prefix:
        if last._content:
            return ThinkingInitialStage.ContentContinuation
        if last._reasoning_content:
            return ThinkingInitialStage.ReasoningContinuation
    return ThinkingInitialStage.ReasoningStart


def is_empty_thinking_tool_call_id(id_: str) -> bool:
    if not id_.isascii():
        return False
    return (len(id_) > 10 and id_[8:11] == "ET_") or (len(id_) > 7 and id_[6:8] == "ET")


def normalize_reasoning_content(messages: list, thinking_mode: bool, has_tools: bool, reject: bool) -> None:
    """Clear reasoning outside thinking mode; fill (or reject) missing reasoning in thinking mode."""
    last_user = max((i for i, m in enumerate(messages) if isinstance(m, UserMessage)), default=None)
    for index, m in enumerate(messages):
        if not isinstance(m, AssistantMessage):
            continue
        if not thinking_mode:
            m._reasoning_content = None
            continue
        if m._reasoning_content is not None:
            continue
        required = last_user is None or index > last_user
        empty_thinking = m._tool_calls is not None and any(
            is_empty_thinking_tool_call_id(c._id) for c in m._tool_calls
        )
        must = required and not empty_thinking and (m._tool_calls is not None or has_tools)
        if must and reject:
            raise ConversionError(
                "The `reasoning_content` in the thinking mode must be passed back to the API."
            )
        m._reasoning_content = ""


def validate_prefix(messages: list) -> bool:
    index = next((i for i, m in enumerate(messages) if isinstance(m, AssistantMessage) and m._prefix), None)
    if index is None:
        return False
    if index != len(messages) - 1:
        raise ConversionError(
            "Invalid completion message: prefix set true with message which is not final message or message "
            "role is not assistant"
        )
    return True


def contains_json_instruction(messages: list) -> bool:
    return any(_JSON_WORD.search(m.content) for m in messages)


_JSON_WORD = re.compile(r"[jJ][sS][oO][nN]")
_NAME_OK = re.compile(r"[A-Za-z0-9_-]+")


def validate_tool_name(name: str, path: str) -> None:
    if not name:
        raise ConversionError(
            f"Invalid '{path}.name': empty string. Expected a string with minimum length 1, but got an empty "
            "string instead."
        )
    n = len(name.encode("utf-8"))
    if n > MAX_TOOL_NAME_LEN:
        raise ConversionError(
            f"Invalid '{path}.name': string too long. Expected a string with maximum length {MAX_TOOL_NAME_LEN}, "
            f"but got a string with length {n} instead."
        )
    if not _NAME_OK.fullmatch(name) or not name.isascii():
        raise ConversionError(
            f"Invalid '{path}.name': string does not match pattern. Expected a string that matches the pattern "
            "'^[a-zA-Z0-9_-]+$'."
        )


def validate_stop_sequences(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_SEQUENCES:
        raise ConversionError(f"Stop string array too long: {len(stop)}")
    for index, s in enumerate(stop):
        if not s:
            raise ConversionError(
                f"Invalid 'stop[{index}]': empty string. Expected a string with minimum length 1, but got an "
                "empty string instead."
            )


def validate_stop_sequence(stop: str) -> None:
    if not stop:
        raise ConversionError(
            "Invalid 'stop': empty string. Expected a string with minimum length 1, but got an empty string instead."
        )


def normalize_tool_parameters(name: str, parameters: Any, strict: bool | None) -> Any:
    if strict is True:
        schema = default_strict_schema() if parameters is None else parameters
        return normalize_strict_schema(
            schema,
            True,
            "Invalid tool parameters schema : ",
            "The top level of the function parameters schema must be an object.",
        )
    if parameters is None:
        return None
    err = validate_schema(parameters)
    if err is not None:
        raise ConversionError(f"Invalid schema for function '{name}': {err}")
    schema_type = parameters.get("type") if type(parameters) is dict else None
    if schema_type != "object":
        raise ConversionError(
            f"Invalid schema for function '{name}': schema must be a JSON Schema of 'type: \"object\"', "
            f"got 'type: {_json.dumps_compact(schema_type)}'."
        )
    return parameters


def validate_response_schema(schema: Any, strict: bool | None) -> Any:
    if strict is True:
        return normalize_strict_schema(
            schema, False, "Invalid json schema: ", "The top level of the json schema must be an object."
        )
    err = validate_schema(schema)
    if err is not None:
        raise ConversionError(f"Invalid json schema: {err}")
    return schema


@dataclass
class ClientTool:
    name: str
    description: str | None
    parameters: Any
    strict: bool | None
    defer_loading: bool = False


def convert_client_tools(
    tools: list[ClientTool], choice: Any, thinking_mode: bool
) -> tuple[list[ToolDefinition], str]:
    """choice: "auto", "required" or ("named", name)."""
    names: set[str] = set()
    definitions: list[ToolDefinition] = []
    for tool in tools:
        if tool.name in names:
            raise ConversionError("Tool names must be unique.")
        names.add(tool.name)
        params = normalize_tool_parameters(tool.name, tool.parameters, tool.strict)
        definitions.append(
            ToolDefinition(
                tool.name, tool.description, {} if params is None else params, tool.strict, tool.defer_loading
            )
        )
    if isinstance(choice, tuple):
        name = choice[1]
        if name not in names:
            raise ConversionError(
                f"Invalid value for 'tool_call': no function named '{name}' was specified in the 'tools' parameter."
            )
        definitions = [t for t in definitions if t._name == name]
        required = True
    else:
        required = choice == "required"
    if required and thinking_mode:
        raise ConversionError("Thinking mode does not support this tool_choice")
    return definitions, ("required" if required else "auto")


def resolve_output_constraint(
    tools: list[ToolDefinition], tool_choice: str, fmt: tuple, has_response_format: bool
):
    """fmt: ("text",) | ("json_object",) | ("json_schema", schema) | ("regex", regex)."""
    if tools and tool_choice != "none":
        if any(t._strict is True for t in tools):
            if any(t._strict is not True for t in tools):
                raise ConversionError("Cannot use strict tool with non-strict tool in the same request")
            if has_response_format:
                raise ConversionError("response_format should not be used with tools")
        defs = []
        for t in tools:
            d: dict = {
                "type": "function",
                "function": {
                    "name": t._name,
                    "description": t._description,
                    "parameters": t._parameters,
                    "strict": t._strict,
                },
            }
            if t._defer_loading:
                d["defer_loading"] = True
            defs.append(d)
        kind = "tool_call_required" if tool_choice == "required" else "tool_call"
        return OutputConstraint(kind=kind, schema=_json.dumps_compact(defs))
    if fmt[0] == "json_object":
        return OutputConstraint(kind="json", schema="")
    if fmt[0] == "json_schema":
        return OutputConstraint(kind="json", schema=_json.dumps_compact(fmt[1]))
    if fmt[0] == "regex":
        return OutputConstraint(kind="regex", schema=fmt[1])
    return None


def inference_options(
    *,
    thinking_mode: bool,
    upper_bound: int,
    n=None,
    presence_penalty=None,
    frequency_penalty=None,
    temperature=None,
    top_p=None,
    logprobs=None,
    top_logprobs=None,
    max_tokens=None,
    clamp_max_tokens=False,
    seed=None,
) -> dict:
    if n is not None and n != 1:
        raise ConversionError("Invalid n value (currently only n = 1 is supported)")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is not None and not -2.0 <= value <= 2.0:
            raise ConversionError(f"Invalid {name} value, the valid range of {name} is [-2, 2]")
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise ConversionError("Invalid temperature value, the valid range of temperature is [0, 2]")
    if top_p is not None and (
        top_p != top_p or top_p in (float("inf"), float("-inf")) or top_p <= 0.0 or top_p > 1.0
    ):
        raise ConversionError("Invalid top_p value, the valid range of top_p is (0, 1.0]")
    lp = logprobs is True
    if top_logprobs is not None:
        if not lp:
            raise ConversionError(
                "Invalid top_logprobs and logprobs value, logprobs must be set to true if top_logprobs is used."
            )
        if top_logprobs > 20:
            raise ConversionError("Invalid top_logprobs value, the valid range of top_logprobs is [0, 20].")
    if max_tokens is not None and clamp_max_tokens:
        max_tokens = min(max_tokens, upper_bound)
    if max_tokens is not None and not 1 <= max_tokens <= upper_bound:
        raise ConversionError(
            f"Invalid max_tokens value, the valid range of max_tokens is [1, {upper_bound}]"
        )
    if seed is not None and seed >= 1 << 63:
        raise ConversionError("Invalid seed value, the valid range of seed is [0, 2^63)")
    return {
        "max_tokens": max_tokens,
        "temperature": 1.0 if thinking_mode else (1.0 if temperature is None else temperature),
        "top_p": top_p,
        "logprobs": lp,
        "top_logprobs": top_logprobs,
        "seed": seed,
    }


# -- images ----------------------------------------------------------------------------------


def is_http_url(url: str) -> bool:
    return url[:4].lower() == "http"


_MEDIA = ("image/jpeg", "image/png", "image/gif", "image/webp")


def image_url_source(url: str, detail: str | None, path: str, too_long) -> ImageSource:
    from ..messages import UrlImageSource

    detail = detail or "high"
    if is_http_url(url):
        if len(url.encode("utf-8")) > MAX_IMAGE_URL_LEN:
            raise ConversionError(too_long(len(url.encode("utf-8"))))
        return UrlImageSource(url, detail, path=path)
    return DataUrlImageSource(url, detail, path=path)


def _parse_data_url(data_url: str):
    """Returns (mime, body, is_base64) or None when it is not a data URL."""
    s = data_url.strip()
    if s[:5].lower() != "data:":
        return None
    rest = s[5:]
    comma = rest.find(",")
    if comma < 0:
        return None
    meta, body = rest[:comma], rest[comma + 1 :]
    parts = [p.strip() for p in meta.split(";")]
    is_b64 = bool(parts) and parts[-1].lower() == "base64"
    if is_b64:
        parts = parts[:-1]
    mime = (parts[0] if parts and parts[0] else "text/plain").lower()
    return mime, body, is_b64


def _b64_ok(body: str) -> bool:
    import base64
    import binascii

    data = re.sub(r"[\t\n\f\r ]", "", body)
    if len(data) % 4 == 1:
        return False
    data = data.rstrip("=")
    data += "=" * (-len(data) % 4)
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def validate_data_url_sources(sources: list[ImageSource], path: str) -> None:
    for source in sources:
        if source.kind != "data_url":
            continue
        data_url = source.data_url
        if "base64," not in data_url:
            raise ConversionError(f"{path}: Unsupported image_url format")
        parsed = _parse_data_url(data_url)
        if parsed is None:
            raise ConversionError(f"{path}: Unsupported image_url format")
        mime, body, _ = parsed
        mime = mime.split(";")[0].strip()
        if mime not in _MEDIA:
            raise ConversionError(f"{path}: {UNSUPPORTED_IMAGE_ERROR_MESSAGE}")
        if not _b64_ok(body):
            raise ConversionError(f"{path}: Invalid base64 data")


def file_data_image_source(file_data: str, path: str) -> ImageSource:
    parsed = _parse_data_url(file_data)
    if parsed is None:
        raise ConversionError(f"{path}: file_data is not a valid base64 data url")
    mime, body, _ = parsed
    if mime.split(";")[0].strip() not in _MEDIA:
        raise ConversionError(f"{path}: {UNSUPPORTED_FILE_ERROR_MESSAGE}")
    if not _b64_ok(body):
        raise ConversionError(f"{path}: file_data is not a valid base64 data url")
    return DataUrlImageSource(file_data, "high", path=path)


def file_id_unsupported(path: str) -> ConversionError:
    return ConversionError(f"{path}: file_id is not supported. Pass the image as a base64 data url instead.")
