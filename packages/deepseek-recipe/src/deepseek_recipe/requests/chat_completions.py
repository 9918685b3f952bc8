"""OpenAI Chat Completions request → `ConversationRequest`."""

from __future__ import annotations

from typing import Any

from ..encoding.prompt import Prompt
from ..errors import ConversionError
from ..messages import (
    AssistantMessage,
    Conversation,
    LatestReminderMessage,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from ..options import ConversionOptions, InferenceOptions, ModelVersion, ParsingOptions
from . import _common as C
from ._serde import Reader, SchemaError, tagged, variant

__all__ = ["ChatCompletionRequest"]

_ROLES = ("system", "user", "assistant", "tool", "latest_reminder")


def _content(value: Any) -> Any:
    """ChatCompletionRequestContent: a string or a list of typed blocks."""
    if type(value) is str:
        return value
    if type(value) is list:
        blocks = []
        for b in value:
            kind = tagged(
                b,
                "type",
                ("text", "image_url", "file"),
                "internally tagged enum ChatCompletionRequestContentBlock",
            )
            r = Reader(b, "struct")
            if kind == "text":
                blocks.append(("text", r.req("text", "str")))
            elif kind == "image_url":
                iu = Reader(r.required("image_url"), "struct ChatCompletionImageUrl")
                detail = iu.opt_variant("detail", C.IMAGE_DETAILS)
                blocks.append(("image_url", iu.req("url", "str"), detail))
            else:
                blocks.append(
                    ("file", r.opt("file_id", "str"), r.opt("file_data", "str"), r.opt("filename", "str"))
                )
        return blocks
    raise SchemaError("content should be a string or a list")


def _parse(value: Any) -> dict:
    r = Reader(value, "struct ChatCompletionRequest")
    out: dict[str, Any] = {}
    msgs = r.as_list(r.required("messages"))
    parsed_msgs = []
    for m in msgs:
        role = tagged(m, "role", _ROLES, "internally tagged enum ChatCompletionRequestMessage")
        mr = Reader(m, "struct")
        if role in ("system", "user"):
            parsed_msgs.append(
                {"role": role, "content": _content(mr.required("content")), "name": mr.opt("name", "str")}
            )
        elif role == "assistant":
            content = mr.raw("content")
            calls = mr.opt("tool_calls", "list")
            if calls is not None:
                pc = []
                for c in calls:
                    cr = Reader(c, "struct ChatCompletionRequestToolCall")
                    cid = cr.req("id", "str")
                    variant(cr.required("type"), ("function",))
                    fr = Reader(cr.required("function"), "struct ChatCompletionRequestFunctionCall")
                    pc.append((cid, fr.req("name", "str"), fr.req("arguments", "str")))
                calls = pc
            parsed_msgs.append(
                {
                    "role": role,
                    "content": None if content is None else _content(content),
                    "reasoning_content": mr.opt("reasoning_content", "str"),
                    "name": mr.opt("name", "str"),
                    "tool_calls": calls,
                    "prefix": mr.opt("prefix", "bool"),
                }
            )
        elif role == "tool":
            parsed_msgs.append(
                {
                    "role": role,
                    "content": _content(mr.required("content")),
                    "tool_call_id": mr.req("tool_call_id", "str"),
                }
            )
        else:
            parsed_msgs.append({"role": role, "content": mr.req("content", "str")})
    out["messages"] = parsed_msgs
    out["model"] = r.req("model", "str")
    out["frequency_penalty"] = r.opt("frequency_penalty", "f32")
    out["logprobs"] = r.opt("logprobs", "bool")
    out["top_logprobs"] = r.opt("top_logprobs", "uint", 8)
    out["max_tokens"] = r.opt("max_tokens", "uint", 32)
    out["n"] = r.opt("n", "uint", 8)
    out["presence_penalty"] = r.opt("presence_penalty", "f32")
    out["seed"] = r.opt("seed", "uint", 64)
    stop = r.raw("stop")
    if stop is not None:
        if type(stop) is list:
            stop = ("list", [Reader.as_str(x) for x in stop])
        elif type(stop) is str:
            stop = ("str", stop)
        else:
            raise SchemaError("expected a string or a list")
    out["stop"] = stop
    out["stream"] = r.opt("stream", "bool")
    so = r.raw("stream_options")
    if so is not None:
        so = {"include_usage": Reader(so, "struct ChatCompletionStreamOptions").opt("include_usage", "bool")}
    out["stream_options"] = so
    out["temperature"] = r.opt("temperature", "f32")
    out["top_p"] = r.opt("top_p", "f32")
    rf = r.raw("response_format")
    if rf is not None:
        kind = tagged(rf, "type", ("json_object", "json_schema", "regex", "text"), "internally tagged enum")
        rr = Reader(rf, "struct")
        if kind == "json_schema":
            js = Reader(rr.required("json_schema"), "struct ChatCompletionResponseFormatJsonSchema")
            rf = ("json_schema", js.required("schema"), js.opt("name", "str"), js.opt("strict", "bool"))
        elif kind == "regex":
            rf = ("regex", rr.req("regex", "str"))
        else:
            rf = (kind,)
    out["response_format"] = rf
    tools = r.opt("tools", "list")
    if tools is not None:
        pt = []
        for t in tools:
            tr = Reader(t, "struct ChatCompletionTool")
            variant(tr.required("type"), ("function",))
            fr = Reader(tr.required("function"), "struct ChatCompletionFunctionDefinition")
            pt.append(
                C.ClientTool(
                    fr.req("name", "str"),
                    fr.opt("description", "str"),
                    fr.raw("parameters"),
                    fr.opt("strict", "bool"),
                )
            )
        tools = pt
    out["tools"] = tools
    tc = r.raw("tool_choice")
    if tc is not None:
        if tc in ("none", "auto", "required"):
            pass
        elif type(tc) is dict and "type" in tc:
            tcr = Reader(tc, "struct")
            variant(tcr.required("type"), ("function",))
            fn = Reader(tcr.required("function"), "struct ChatCompletionToolChoiceFunction")
            tc = ("named", fn.req("name", "str"))
        else:
            raise SchemaError("expected one of `none`, `auto`, `required` or a tool")
    out["tool_choice"] = tc
    out["reasoning_effort"] = r.opt_variant("reasoning_effort", C.REQUEST_EFFORTS)
    th = r.raw("thinking")
    if th is not None:
        thr = Reader(th, "struct ChatCompletionThinking")
        th = variant(thr.required("type"), ("adaptive", "enabled", "disabled"))
        thr.opt("budget_tokens", "uint", 64)
    out["thinking"] = th
    out["parallel_tool_calls"] = r.opt("parallel_tool_calls", "bool")
    return out


def _into_content(content: Any, index: int, image_token: str, mv: ModelVersion):
    if type(content) is str:
        return Prompt.plain(content), []
    path = f".messages[{index}]"
    parts: list[Prompt] = []
    sources = []
    for block_index, b in enumerate(content):
        kind = b[0]
        if kind == "text":
            parts.append(Prompt.plain(b[1]))
        elif not mv.supports_image():
            parts.append(Prompt.plain(C.UNSUPPORTED_IMAGE_PLACEHOLDER))
        elif kind == "image_url":
            url, detail = b[1], b[2]
            sources.append(
                C.image_url_source(
                    url,
                    detail,
                    path,
                    lambda n, bi=block_index: (
                        f"{path}.image_url.url[{bi}]: image_url.url external link length {n} too long, max link "
                        f"length {C.MAX_IMAGE_URL_LEN}. Consider passing file data directly with base64 data url "
                        "instead."
                    ),
                )
            )
            p = Prompt()
            p.push_special(image_token)
            parts.append(p)
        else:
            _, file_id, file_data, filename = b
            if file_id is None and file_data is None:
                raise ConversionError(f"{path}: file must have a file_id or file_data")
            if file_id is not None and file_data is not None:
                raise ConversionError(f"{path}: file cannot have both file_id and file_data")
            if file_id is not None and filename is not None:
                raise ConversionError(f"{path}: file cannot have filename when file_id is present")
            if file_id is not None:
                raise C.file_id_unsupported(path)
            sources.append(C.file_data_image_source(file_data, path))
            p = Prompt()
            p.push_special(image_token)
            parts.append(p)
    return C.join_paragraphs(parts), sources


def _strip_billing_header(content: Prompt) -> Prompt:
    text = content.text()
    if not text.startswith("x-anthropic-billing-header"):
        return content
    found = [i for i in (text.find("\n"), text.find("You are")) if i >= 0]
    if not found:
        return Prompt()
    start = min(found)
    start = len(text) - len(text[start:].lstrip())
    return _split_prompt(content, start)


def _split_prompt(p: Prompt, start: int) -> Prompt:
    """The part of `p` from code point `start` on."""
    out = Prompt()
    pos = 0
    for text, special in p.parts:
        end = pos + len(text)
        if end <= start:
            pos = end
            continue
        if special:
            out.push_special(text)
        else:
            out.push_plain(text[max(0, start - pos) :])
        pos = end
    return out


def _transform_messages(messages: list, image_token: str, mv: ModelVersion) -> list:
    if not messages:
        raise ConversionError("Empty input messages")
    result: list = []
    i = 0
    n = len(messages)
    while i < n:
        m = messages[i]
        index = i
        i += 1
        role = m["role"]
        if role == "system":
            content, sources = _into_content(m["content"], index, image_token, mv)
            content = _strip_billing_header(content)
            if not content.is_empty():
                C.validate_data_url_sources(sources, f".messages[{index}]")
                result.append(SystemMessage._from_prompt(content, sources, _tools=None))
        elif role == "user":
            content, sources = _into_content(m["content"], index, image_token, mv)
            C.validate_data_url_sources(sources, f".messages[{index}]")
            result.append(UserMessage._from_prompt(content, sources))
        elif role == "assistant":
            if m["content"] is None and m["tool_calls"] is None:
                raise ConversionError("Invalid assistant message: content or tool_calls must be set")
            if m["content"] is not None:
                content, sources = _into_content(m["content"], index, image_token, mv)
            else:
                content, sources = Prompt(), []
            if sources:
                raise ConversionError("Image in assistant message is not supported")
            tool_results = []
            calls = None
            if m["tool_calls"] is not None:
                tcs = m["tool_calls"]
                if not tcs:
                    raise ConversionError(
                        f"Invalid 'messages[{index}].tool_calls': empty array. Expected an array with minimum length 1, "
                        "but got an empty array instead."
                    )
                ids: set[str] = set()
                for cid, _, _ in tcs:
                    if cid in ids:
                        raise ConversionError(
                            f"Duplicate value for 'tool_call_id' of {cid} in message[{index}]"
                        )
                    ids.add(cid)
                checked: set[str] = set()
                for _ in range(len(tcs)):
                    if i >= n or messages[i]["role"] != "tool":
                        raise ConversionError(
                            "An assistant message with 'tool_calls' must be followed by tool messages responding to "
                            "each 'tool_call_id'. (insufficient tool messages following tool_calls message)"
                        )
                    tm = messages[i]
                    ti = i
                    i += 1
                    tcid = tm["tool_call_id"]
                    if tcid not in ids:
                        raise ConversionError(
                            "An assistant message with 'tool_calls' must be followed by tool messages responding to "
                            f"each 'tool_call_id', The following tool_call_ids did not have response messages: {tcid}"
                        )
                    if tcid in checked:
                        raise ConversionError(
                            f"Duplicate value for 'tool_call_id' of {tcid} in message[{ti}]"
                        )
                    checked.add(tcid)
                    tcontent, tsources = _into_content(tm["content"], ti, image_token, mv)
                    C.validate_data_url_sources(tsources, f".messages[{ti}]")
                    tool_results.append(ToolMessage._from_prompt(tcontent, tsources, _tool_call_id=tcid))
                calls = [ToolCall(cid, name, args) for cid, name, args in tcs]
            result.append(
                AssistantMessage(content.text(), m["reasoning_content"], calls, m["prefix"] is True)
            )
            result.extend(tool_results)
        elif role == "tool":
            raise ConversionError(
                "Messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
            )
        else:
            result.append(LatestReminderMessage(m["content"]))
    return result


class ChatCompletionRequest(C.ProtocolRequest):
    """An OpenAI Chat Completions request (dict, JSON str or bytes)."""

    _parse_request = staticmethod(_parse)

    def convert(self, options: ConversionOptions | None = None) -> C.ConversationRequest:
        options = self._consume(options)
        q = self._req
        mv = options.resolve_model_version(q["model"])
        thinking, effort = C.resolve_thinking_mode(
            options.default_thinking_mode, q["thinking"], q["reasoning_effort"]
        )
        tools = q["tools"] or []
        for index, tool in enumerate(tools):
            C.validate_tool_name(tool.name, f"tools[{index}].function")
        has_tools = bool(tools)
        has_tool_context = has_tools or any(
            (m["role"] == "assistant" and m["tool_calls"] is not None) or m["role"] == "tool"
            for m in q["messages"]
        )
        image_token = options.special_tokens.image
        messages = _transform_messages(q["messages"], image_token, mv)
        C.normalize_reasoning_content(
            messages, thinking, has_tools, options.reasoning_content_behavior.value == "reject"
        )
        prefix = C.validate_prefix(messages)
        rf = q["response_format"]
        json_mode = rf is not None and rf[0] == "json_object"
        if json_mode and not C.contains_json_instruction(messages):
            raise ConversionError(
                "Prompt must contain the word 'json' in some form to use 'response_format' of type 'json_object'."
            )
        if q["tool_choice"] == "none":
            tool_defs, tool_choice = [], "none"
        elif not tools:
            tool_defs, tool_choice = [], "auto"
        else:
            tc = q["tool_choice"]
            choice = tc if isinstance(tc, tuple) else ("required" if tc == "required" else "auto")
            tool_defs, tool_choice = C.convert_client_tools(tools, choice, thinking)
        if json_mode and prefix:
            raise ConversionError("response_format json_object should not be used with prefix")
        if has_tool_context and prefix:
            raise ConversionError("Function call should not be used with prefix")
        stop = q["stop"]
        if stop is not None:
            if stop[0] == "list":
                C.validate_stop_sequences(stop[1])
            else:
                C.validate_stop_sequence(stop[1])
        if q["stream"] is not True and q["stream_options"] is not None:
            raise ConversionError("stream_options should be set along with stream = true")
        conv_kw: dict[str, Any] = {}
        if rf is None or rf[0] == "text":
            fmt = ("text",)
        elif rf[0] == "json_object":
            fmt = ("json_object",)
            conv_kw["response_format"] = "json_object"
        elif rf[0] == "json_schema":
            constraint = C.validate_response_schema(rf[1], rf[3])
            fmt = ("json_schema", constraint)
            conv_kw["response_schema"] = rf[1]
        else:
            fmt = ("regex", rf[1])
            conv_kw["response_regex"] = rf[1]
        oc = C.resolve_output_constraint(tool_defs, tool_choice, fmt, rf is not None)
        io = C.inference_options(
            thinking_mode=thinking,
            upper_bound=options.resolve_max_tokens_upper_bound(thinking),
            n=q["n"],
            presence_penalty=q["presence_penalty"],
            frequency_penalty=q["frequency_penalty"],
            temperature=q["temperature"],
            top_p=q["top_p"],
            logprobs=q["logprobs"],
            top_logprobs=q["top_logprobs"],
            max_tokens=q["max_tokens"],
            seed=q["seed"],
        )
        parse_tool_calls = bool(tool_defs) and tool_choice != "none"
        io["top_p"] = mv.resolve_top_p(q["top_p"], thinking, parse_tool_calls)
        inference = InferenceOptions(**io, output_constraint=oc)
        parsing = ParsingOptions(
            parse_tool_calls=parse_tool_calls,
            starts_in_tool_calls=tool_choice == "required",
            parse_json_output=json_mode,
            thinking_initial_stage=C.thinking_initial_stage(messages) if thinking else None,
            stop_sequences=[] if stop is None else (stop[1] if stop[0] == "list" else [stop[1]]),
            special_tokens=options.special_tokens,
        )
        conversation = Conversation(
            messages,
            thinking_mode=thinking,
            tools=tool_defs,
            tool_choice=tool_choice,
            reasoning_effort=effort,
            **conv_kw,
        )
        so = q["stream_options"]
        ro = C.ResponseOptions(include_usage=bool(so and so["include_usage"]))
        return C.ConversationRequest._build(conversation, inference, parsing, mv, q["stream"] is True, ro)

    @staticmethod
    def chunk_generator(request: C.ConversationRequest, id: str, model: str):  # noqa: A002 - official name
        from ..responses.chat_completions import ChatCompletionChunkGenerator

        return ChatCompletionChunkGenerator(
            id,
            model,
            include_usage=not request.stream or request._response_options.include_usage,
            thinking_mode=request.conversation.thinking_mode,
            starts_in_reasoning=request.parsing_options.thinking_initial_stage is not None
            and request.parsing_options.thinking_initial_stage.starts_in_reasoning(),
        )
