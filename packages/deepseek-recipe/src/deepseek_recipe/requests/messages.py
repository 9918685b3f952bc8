"""Anthropic Messages request → `ConversationRequest`."""

from __future__ import annotations

from typing import Any

from .. import _json
from ..encoding.prompt import Prompt
from ..errors import ConversionError
from ..messages import (
    AssistantMessage,
    Conversation,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from ..options import ConversionOptions, InferenceOptions, ModelVersion, ParsingOptions, ThinkingInitialStage
from . import _common as C
from ._serde import Reader, SchemaError, tagged, variant

__all__ = ["MessagesRequest"]

_BLOCKS = (
    "text",
    "image",
    "document",
    "thinking",
    "server_tool_use",
    "tool_use",
    "tool_result",
    "web_search_tool_result",
    "tool_addition",
)
_MEDIA = {
    "image/jpeg": "image/jpeg",
    "image/jpg": "image/jpeg",
    "image/png": "image/png",
    "image/gif": "image/gif",
    "image/webp": "image/webp",
}


def _image_source(v: Any) -> tuple:
    kind = tagged(v, "type", ("base64", "url", "file"), "internally tagged enum MessagesImageSource")
    r = Reader(v, "struct")
    if kind == "base64":
        mt = r.required("media_type")
        if type(mt) is not str or mt not in _MEDIA:
            variant(mt, ("image/jpeg", "image/png", "image/gif", "image/webp"))
        return ("base64", _MEDIA[mt], r.req("data", "str"))
    if kind == "url":
        return ("url", r.req("url", "str"))
    return ("file", r.req("file_id", "str"))


def _block(v: Any) -> dict:
    kind = tagged(v, "type", _BLOCKS, "internally tagged enum MessagesContentBlock")
    r = Reader(v, "struct")
    b: dict[str, Any] = {"type": kind}
    if kind == "text":
        b["text"] = r.req("text", "str")
    elif kind == "image":
        b["source"] = _image_source(r.required("source"))
    elif kind == "document":
        b["media_type"] = Reader(r.required("source"), "struct MessagesDocumentSource").opt(
            "media_type", "str"
        )
    elif kind == "thinking":
        r.opt("signature", "str")
        b["thinking"] = r.req("thinking", "str")
    elif kind in ("server_tool_use", "tool_use"):
        b["id"] = r.req("id", "str")
        b["name"] = r.req("name", "str")
        b["input"] = r.required("input")
    elif kind == "tool_result":
        b["tool_use_id"] = r.req("tool_use_id", "str")
        content = r.raw("content")
        if content is not None:
            if type(content) is str:
                pass
            elif type(content) is list:
                blocks = []
                for x in content:
                    k = tagged(
                        x, "type", ("text", "image", "document", "tool_reference"), "internally tagged enum"
                    )
                    xr = Reader(x, "struct")
                    if k == "text":
                        blocks.append(("text", xr.req("text", "str")))
                    elif k == "image":
                        blocks.append(("image", _image_source(xr.required("source"))))
                    elif k == "document":
                        blocks.append(
                            ("document", Reader(xr.required("source"), "struct").opt("media_type", "str"))
                        )
                    else:
                        blocks.append(("tool_reference", xr.req("tool_name", "str")))
                content = blocks
            else:
                raise SchemaError("expected a string or a list")
        b["content"] = content
        r.opt("is_error", "bool")
    elif kind == "web_search_tool_result":
        b["tool_use_id"] = r.req("tool_use_id", "str")
        r.required("content")
    else:
        t = r.required("tool")
        tagged(t, "type", ("tool_reference",), "internally tagged enum MessagesToolReference")
        b["name"] = Reader(t, "struct").req("name", "str")
    return b


def _content(v: Any) -> Any:
    if type(v) is str:
        return v
    if type(v) is list:
        return [_block(b) for b in v]
    raise SchemaError("expected a string or a list")


def _parse(value: Any) -> dict:
    r = Reader(value, "struct MessagesRequest")
    q: dict[str, Any] = {"model": r.req("model", "str")}
    msgs = []
    for m in r.as_list(r.required("messages")):
        role = tagged(m, "role", ("user", "assistant", "system"), "adjacently tagged enum MessagesMessage")
        if "content" not in m:
            raise SchemaError("missing field `content`")
        msgs.append((role, _content(m["content"])))
    q["messages"] = msgs
    system = r.raw("system")
    if system is not None:
        if type(system) is str:
            pass
        elif type(system) is list:
            texts = []
            for b in system:
                tagged(b, "type", ("text",), "internally tagged enum MessagesSystemBlock")
                texts.append(Reader(b, "struct").req("text", "str"))
            system = texts
        else:
            raise SchemaError("expected a string or a list")
    q["system"] = system
    q["max_tokens"] = r.opt("max_tokens", "uint", 32)
    q["temperature"] = r.opt("temperature", "f32")
    q["top_p"] = r.opt("top_p", "f32")
    stop = r.opt("stop_sequences", "list")
    q["stop_sequences"] = None if stop is None else [Reader.as_str(s) for s in stop]
    q["stream"] = r.opt("stream", "bool")
    tools = r.opt("tools", "list")
    if tools is not None:
        parsed = []
        for t in tools:
            if type(t) is dict and "type" in t:
                tr = Reader(t, "struct MessagesServerTool")
                parsed.append(("server", tr.req("type", "str"), tr.opt("name", "str")))
            elif type(t) is dict and "name" in t:
                tr = Reader(t, "struct")
                parsed.append(
                    (
                        "client",
                        tr.req("name", "str"),
                        tr.opt("description", "str"),
                        tr.required("input_schema"),
                        tr.opt("defer_loading", "bool"),
                    )
                )
            else:
                raise SchemaError("missing field `name`")
        tools = parsed
    q["tools"] = tools
    tc = r.raw("tool_choice")
    if tc is not None:
        kind = tagged(
            tc, "type", ("auto", "any", "tool", "none"), "internally tagged enum MessagesToolChoice"
        )
        tcr = Reader(tc, "struct")
        tcr.opt("disable_parallel_tool_use", "bool")
        tc = ("tool", tcr.req("name", "str")) if kind == "tool" else (kind,)
    q["tool_choice"] = tc
    th = r.raw("thinking")
    if th is not None:
        thr = Reader(th, "struct MessagesThinking")
        th = variant(thr.required("type"), ("adaptive", "enabled", "disabled"))
        thr.opt("budget_tokens", "uint", 64)
    q["thinking"] = th
    oc = r.raw("output_config")
    effort = None
    if oc is not None:
        effort = Reader(oc, "struct MessagesOutputConfig").opt_variant("effort", C.REQUEST_EFFORTS)
    q["effort"] = effort
    md = r.raw("metadata")
    if md is not None:
        Reader(md, "struct MessagesMetadata").opt("user_id", "str")
    return q


def _normalize_b64(data: str) -> str:
    if not data.endswith("="):
        return data
    unpadded = data.rstrip("=")
    rem = len(unpadded) % 4
    if rem == 1:
        return data
    return unpadded + "=" * ((4 - rem) % 4)


def _image_block(source: tuple, path: str, image_path: str, image_token: str, mv: ModelVersion):
    from ..messages import DataUrlImageSource, UrlImageSource

    if not mv.supports_image():
        return Prompt.plain(C.UNSUPPORTED_IMAGE_PLACEHOLDER), None
    if source[0] == "base64":
        import base64
        import binascii

        data = _normalize_b64(source[2])
        try:
            base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ConversionError(f"{path}: base64 decode error") from None
        src = DataUrlImageSource(f"data:{source[1]};base64,{data}", "high", path=image_path)
    elif source[0] == "url":
        url = source[1]
        if not C.is_http_url(url):
            raise ConversionError(f"{path}: invalid url: {_json.dumps_compact(url)}")
        n = len(url.encode("utf-8"))
        if n > C.MAX_IMAGE_URL_LEN:
            raise ConversionError(
                f"{path}: external link length {n} too long, max link length {C.MAX_IMAGE_URL_LEN}. "
                "Consider passing file data directly with base64 data url instead."
            )
        src = UrlImageSource(url, "high", path=image_path)
    else:
        raise C.file_id_unsupported(path)
    p = Prompt()
    p.push_special(image_token)
    return p, src


def _doc(media_type: str | None) -> Prompt:
    return Prompt.plain(f"[Unsupported document type: {media_type or 'unknown'}]")


def _simple_block(b: dict, path: str, image_path: str, image_token: str, mv: ModelVersion):
    if b["type"] == "text":
        return Prompt.plain(b["text"]), None
    if b["type"] == "image":
        return _image_block(b["source"], path, image_path, image_token, mv)
    return _doc(b["media_type"]), None


def _pending_error(prefix: str, pending: dict) -> ConversionError:
    ids = ", ".join(sorted(pending))
    return ConversionError(
        f"{prefix}`tool_use` ids were found without `tool_result` blocks immediately after: {ids}. Each `tool_use` "
        "block must have a corresponding `tool_result` block in the next message."
    )


def _tool_def(t: C.ClientTool) -> ToolDefinition:
    return ToolDefinition(
        t.name, t.description, {} if t.parameters is None else t.parameters, t.strict, t.defer_loading
    )


def _transform(
    q: dict, image_token: str, web_search_reject: bool, mv: ModelVersion, tools: list[C.ClientTool]
) -> list:
    messages = q["messages"]
    if not messages:
        raise ConversionError("messages: at least one message is required")
    out: list = []
    system = q["system"]
    if system is not None:
        if type(system) is str:
            content = Prompt.plain(system)
        else:
            parts = [
                Prompt.plain(t)
                for i, t in enumerate(system)
                if not (i == 0 and t.lower().startswith("x-anthropic-billing-header"))
            ]
            content = C.join_paragraphs(parts)
        out.append(SystemMessage._from_prompt(content, [], _tools=None))
    pending: dict[str, int] = {}
    by_name = {t.name: t for t in tools}

    def ensure_no_pending(i: int) -> None:
        if pending:
            raise _pending_error(f"messages.{i}: ", pending)

    for mi, (role, content) in enumerate(messages):
        if role == "user" and type(content) is str:
            ensure_no_pending(mi)
            out.append(UserMessage._from_prompt(Prompt.plain(content), []))
        elif role == "assistant" and type(content) is str:
            ensure_no_pending(mi)
            out.append(AssistantMessage(content, None, None, False))
        elif role == "system":
            ensure_no_pending(mi)
            added: list[ToolDefinition] = []
            if type(content) is str:
                prompt, sources = Prompt.plain(content), []
            else:
                mpath = f"messages.{mi}"
                parts, sources = [], []
                for bi, b in enumerate(content):
                    t = b["type"]
                    if t in ("text", "image", "document"):
                        p, s = _simple_block(b, f"{mpath}.content[{bi}]", mpath, image_token, mv)
                        parts.append(p)
                        if s is not None:
                            sources.append(s)
                    elif t == "tool_addition":
                        tool = by_name.get(b["name"])
                        if tool is None:
                            raise ConversionError(
                                f"messages.{mi}.content.{bi}: `tool_addition` references unknown tool '{b['name']}'"
                            )
                        added.append(_tool_def(tool))
                    elif t == "thinking":
                        raise ConversionError(
                            f"messages.{mi}.content: thinking blocks may only be in `assistant` messages"
                        )
                    elif t in ("tool_use", "server_tool_use"):
                        raise ConversionError(
                            f"messages.{mi}: `tool_use` blocks can only be in `assistant` messages"
                        )
                    elif t == "tool_result":
                        raise ConversionError(
                            f"messages.{mi}: `tool_result` blocks can only be in `user` messages"
                        )
                    else:
                        raise ConversionError(
                            f"messages.{mi}: `web_search_tool_result` blocks can only be in `assistant` messages"
                        )
                prompt = C.join_paragraphs(parts)
            if mv.supports_mid_conversation_system():
                out.append(SystemMessage._from_prompt(prompt, sources, _tools=added or None))
            elif not prompt.is_empty():
                wrapped = Prompt.plain("<system-reminder>\n")
                wrapped.extend(prompt)
                wrapped.push_plain("\n</system-reminder>")
                out.append(UserMessage._from_prompt(wrapped, sources))
        elif role == "user":
            if not content:
                raise ConversionError(f"messages.{mi}: all messages must have non-empty content")
            matched: set[str] = set()
            referenced: list[ToolDefinition] = []
            for bi, b in enumerate(content):
                path = f"messages.{mi}.content[{bi}]"
                t = b["type"]
                if t in ("text", "image", "document"):
                    ensure_no_pending(mi)
                    p, s = _simple_block(b, path, path, image_token, mv)
                    out.append(UserMessage._from_prompt(p, [] if s is None else [s]))
                elif t in ("tool_use", "server_tool_use"):
                    raise ConversionError(
                        f"messages.{mi}: `tool_use` blocks can only be in `assistant` messages"
                    )
                elif t == "tool_result":
                    tid = b["tool_use_id"]
                    if tid in matched:
                        raise ConversionError(
                            f"messages.{mi}.content.{bi}: each tool_use must have a single result. Found multiple "
                            f"`tool_result` blocks with id: {tid}"
                        )
                    if tid not in pending:
                        raise ConversionError(
                            f"unexpected `messages.{mi}.content.{bi}: tool_use_id` found in `tool_result` blocks: {tid}. "
                            "Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
                        )
                    del pending[tid]
                    matched.add(tid)
                    rc = b["content"]
                    if type(rc) is list:
                        for x in rc:
                            if x[0] == "tool_reference":
                                tool = by_name.get(x[1])
                                if tool is None:
                                    raise ConversionError(
                                        f"messages.{mi}.content.{bi}: tool reference '{x[1]}' not found in available tools"
                                    )
                                referenced.append(_tool_def(tool))
                    rpath = f"messages.{mi}.content.{bi}.tool_result"
                    if rc is None:
                        tp, ts = Prompt(), []
                    elif type(rc) is str:
                        tp, ts = Prompt.plain(rc), []
                    else:
                        parts, ts = [], []
                        for xi, x in enumerate(rc):
                            if x[0] == "text":
                                parts.append(Prompt.plain(x[1]))
                            elif x[0] == "image":
                                p, s = _image_block(x[1], f"{rpath}.content[{xi}]", rpath, image_token, mv)
                                parts.append(p)
                                if s is not None:
                                    ts.append(s)
                            elif x[0] == "document":
                                parts.append(_doc(x[1]))
                            else:
                                parts.append(Prompt.plain(x[1]))
                        tp = C.join_paragraphs(parts)
                    out.append(ToolMessage._from_prompt(tp, ts, _tool_call_id=tid))
                elif t == "tool_addition":
                    raise ConversionError(
                        f"messages.{mi}: `tool_addition` blocks can only be in `system` messages"
                    )
                elif t == "thinking":
                    raise ConversionError(
                        f"messages.{mi}.content: thinking blocks may only be in `assistant` messages"
                    )
                else:
                    raise ConversionError(
                        f"messages.{mi}: `web_search_tool_result` blocks can only be in `assistant` messages"
                    )
            if pending:
                raise _pending_error(f"messages.{mi - 1}:", pending)
            if mv.supports_mid_conversation_system() and referenced:
                out.append(SystemMessage._from_prompt(Prompt(), [], _tools=referenced))
        else:  # assistant blocks
            ensure_no_pending(mi)
            if not content:
                raise ConversionError(f"messages.{mi}: all messages must have non-empty content")
            text = ""
            reasoning: str | None = None
            calls: list[ToolCall] | None = None
            for bi, b in enumerate(content):
                path = f"messages.{mi}.content[{bi}]"
                t = b["type"]
                if t in ("text", "image", "document"):
                    if calls is not None:
                        raise _pending_error(f"messages.{mi}.{bi}: ", pending)
                    if text:
                        text += "\n\n"
                    p, s = _simple_block(b, path, path, image_token, mv)
                    if s is not None:
                        raise ConversionError("Image in assistant message is unsupported")
                    text += p.text()
                elif t == "tool_use":
                    if calls is None:
                        calls = []
                    calls.append(ToolCall(b["id"], b["name"], _json.dumps_spaced(b["input"])))
                    if b["id"] in pending:
                        raise ConversionError(f"messages.{mi}.content.{bi}: `tool_use` ids must be unique")
                    pending[b["id"]] = bi
                elif t == "tool_result":
                    raise ConversionError(
                        f"messages.{mi}: `tool_result` blocks can only be in `user` messages"
                    )
                elif t == "tool_addition":
                    raise ConversionError(
                        f"messages.{mi}: `tool_addition` blocks can only be in `system` messages"
                    )
                elif t == "thinking":
                    reasoning = b["thinking"] if reasoning is None else reasoning + "\n\n" + b["thinking"]
                else:
                    if web_search_reject:
                        raise ConversionError("Unsupported content block: server tools are not supported")
            out.append(AssistantMessage(text, reasoning, calls, False))
    if pending:
        raise _pending_error(f"messages.{len(messages) - 1}:", pending)
    return out


def _normalize_message_tools(messages: list, tools: list[ToolDefinition]) -> list:
    by_name = {t._name: t for t in tools}
    kept = []
    for m in messages:
        if isinstance(m, SystemMessage) and m._tools is not None:
            m._tools = [by_name[t._name] for t in m._tools if t._name in by_name]
            if m._prompt.is_empty() and not m._tools:
                continue
        kept.append(m)
    return kept


class MessagesRequest(C.ProtocolRequest):
    """An Anthropic Messages request (dict, JSON str or bytes)."""

    _parse_request = staticmethod(_parse)

    def convert(self, options: ConversionOptions | None = None) -> C.ConversationRequest:
        options = self._consume(options)
        q = self._req
        mv = options.resolve_model_version(q["model"])
        thinking, effort = C.resolve_thinking_mode(options.default_thinking_mode, q["thinking"], q["effort"])
        raw_tools = q["tools"] or []
        client: list[C.ClientTool] = []
        dropped: set[str] = set()
        for index, t in enumerate(raw_tools):
            if t[0] == "server":
                if t[1].startswith("web_search") and options.messages_web_search.value == "drop":
                    dropped.add(t[2] or "web_search")
                    continue
                raise ConversionError(f"tools[{index}]: server tools are not supported")
            _, name, desc, schema, defer = t
            C.validate_tool_name(name, f"tools[{index}]")
            client.append(
                C.ClientTool(
                    name, desc, schema, None, mv.supports_mid_conversation_system() and defer is True
                )
            )
        if client and all(t.defer_loading for t in client):
            raise ConversionError(
                "tools: at least one tool must have defer_loading=false. All tools cannot be deferred."
            )
        messages = _transform(
            q, options.special_tokens.image, options.messages_web_search.value == "reject", mv, client
        )
        try:
            C.normalize_reasoning_content(
                messages, thinking, bool(raw_tools), options.reasoning_content_behavior.value == "reject"
            )
        except ConversionError:
            raise ConversionError(
                "The `content[].thinking` in the thinking mode must be passed back to the API."
            ) from None
        tc = q["tool_choice"]
        if tc is not None and tc[0] == "none":
            tools, tool_choice = [], "none"
        elif not raw_tools:
            tools, tool_choice = [], "auto"
        else:
            if tc is not None and tc[0] == "tool":
                choice = "auto" if tc[1] in dropped else ("named", tc[1])
            else:
                choice = "auto"
            tools, tool_choice = C.convert_client_tools(client, choice, thinking)
        messages = _normalize_message_tools(messages, tools)
        oc = C.resolve_output_constraint(tools, tool_choice, ("text",), False)
        stop = q["stop_sequences"] or []
        C.validate_stop_sequences(stop)
        io = C.inference_options(
            thinking_mode=thinking,
            upper_bound=options.resolve_max_tokens_upper_bound(thinking),
            temperature=q["temperature"],
            top_p=q["top_p"],
            max_tokens=q["max_tokens"],
            clamp_max_tokens=True,
        )
        parse_tool_calls = tool_choice != "none" and bool(tools)
        io["top_p"] = mv.resolve_top_p(q["top_p"], thinking, parse_tool_calls)
        parsing = ParsingOptions(
            parse_tool_calls=parse_tool_calls,
            thinking_initial_stage=ThinkingInitialStage.ReasoningStart if thinking else None,
            stop_sequences=stop,
            starts_in_tool_calls=tool_choice == "required",
            special_tokens=options.special_tokens,
        )
        conversation = Conversation(
            messages, thinking_mode=thinking, tools=tools, tool_choice=tool_choice, reasoning_effort=effort
        )
        return C.ConversationRequest._build(
            conversation,
            InferenceOptions(**io, output_constraint=oc),
            parsing,
            mv,
            q["stream"] is True,
            C.ResponseOptions(),
        )

    @staticmethod
    def chunk_generator(request: C.ConversationRequest, id: str, model: str):  # noqa: A002 - official name
        from ..responses.messages import MessagesChunkGenerator

        return MessagesChunkGenerator(id, model, request.conversation.thinking_mode)
