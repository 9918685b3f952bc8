"""OpenAI Responses request → `ConversationRequest`."""

from __future__ import annotations

import copy
from typing import Any

from .. import _json
from ..encoding.prompt import Prompt
from ..errors import ConversionError
from ..messages import (
    AssistantMessage,
    Conversation,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from ..options import ConversionOptions, InferenceOptions, ModelVersion, ParsingOptions, ThinkingInitialStage
from . import _common as C
from ._serde import Reader, SchemaError, tagged, variant
from .responses_echo import ResponsesEcho

__all__ = ["ResponsesRequest", "ResponsesEcho"]

_ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "custom_tool_call",
    "custom_tool_call_output",
    "tool_search_call",
    "tool_search_output",
    "web_search_call",
)
_ROLES = ("user", "assistant", "system", "developer")


def _message(v: dict) -> dict:
    r = Reader(v, "struct ResponsesInputMessage")
    role = variant(r.required("role"), _ROLES)
    content = r.required("content")
    if type(content) is str:
        pass
    elif type(content) is list:
        blocks = []
        for b in content:
            k = tagged(
                b,
                "type",
                ("input_text", "output_text", "input_image", "input_file"),
                "internally tagged enum ResponsesContentBlock",
            )
            br = Reader(b, "struct")
            if k in ("input_text", "output_text"):
                blocks.append((k, br.req("text", "str")))
            elif k == "input_image":
                blocks.append((k, _image(b)))
            else:
                blocks.append((k,))
        content = blocks
    else:
        raise SchemaError("content should be a string or a list of content blocks")
    return {"kind": "message", "role": role, "content": content}


def _image(b: dict) -> tuple:
    r = Reader(b, "struct ResponsesInputImage")
    detail = r.opt_variant("detail", C.IMAGE_DETAILS)
    return (r.opt("image_url", "str"), detail, r.opt("file_id", "str"))


def _output(v: Any) -> Any:
    if type(v) is str:
        return v
    if type(v) is list:
        items = []
        for b in v:
            k = tagged(
                b,
                "type",
                ("input_text", "input_image", "input_file"),
                "internally tagged enum ResponsesToolCallOutputItem",
            )
            if k == "input_text":
                items.append((k, Reader(b, "struct").req("text", "str")))
            elif k == "input_image":
                items.append((k, _image(b)))
            else:
                items.append((k,))
        return items
    raise SchemaError("output should be a string or a list of output content parts")


def _item(v: Any) -> dict:
    if type(v) is dict and "type" in v:
        t = v["type"]
        if type(t) is str and t not in _ITEM_TYPES:
            return {"kind": "unsupported"}
        t = variant(t, _ITEM_TYPES)
        r = Reader(v, "struct")
        if t == "message":
            return _message(v)
        if t == "function_call":
            return {
                "kind": t,
                "arguments": r.req("arguments", "str"),
                "call_id": r.req("call_id", "str"),
                "name": r.req("name", "str"),
                "namespace": r.opt("namespace", "str"),
            }
        if t == "function_call_output":
            return {"kind": t, "call_id": r.opt("call_id", "str"), "output": _output(r.required("output"))}
        if t == "reasoning":
            content = r.opt("content", "list")
            texts = None
            if content is not None:
                texts = [Reader(c, "struct ResponsesReasoningContent").req("text", "str") for c in content]
            r.opt("encrypted_content", "str")
            return {"kind": t, "texts": texts}
        if t == "custom_tool_call":
            return {
                "kind": t,
                "call_id": r.req("call_id", "str"),
                "name": r.req("name", "str"),
                "input": r.req("input", "str"),
            }
        if t == "custom_tool_call_output":
            out = r.raw("output")
            return {
                "kind": t,
                "call_id": r.req("call_id", "str"),
                "output": None if out is None else _output(out),
            }
        if t in ("tool_search_call", "tool_search_output"):
            return {"kind": "unsupported"}  # tool search needs V4.1 deferred tools; not supported here
        return {"kind": "web_search_call"}
    if type(v) is dict and "role" in v:
        return _message(v)
    raise SchemaError("invalid input item")


def _tool(v: Any) -> tuple:
    kinds = ("function", "web_search", "web_search_2025_08_26", "namespace", "custom", "tool_search")
    if type(v) is dict and type(v.get("type")) is str and v["type"] not in kinds:
        return ("unsupported",)
    k = tagged(v, "type", kinds, "internally tagged enum ResponsesTool")
    r = Reader(v, "struct")
    if k == "function":
        return ("function", _function(v))
    if k in ("web_search", "web_search_2025_08_26"):
        return ("web_search",)
    if k == "namespace":
        inner = []
        for t in r.req("tools", "list"):
            ik = tagged(t, "type", ("function", "custom"), "internally tagged enum ResponsesNamespaceTool")
            inner.append(
                ("function", _function(t))
                if ik == "function"
                else ("custom", Reader(t, "struct").req("name", "str"))
            )
        return ("namespace", r.req("name", "str"), r.opt("description", "str"), inner)
    if k == "custom":
        return ("custom", r.req("name", "str"))
    return ("tool_search",)


def _function(v: dict) -> C.ClientTool:
    r = Reader(v, "struct ResponsesFunctionTool")
    return C.ClientTool(
        r.req("name", "str"), r.opt("description", "str"), r.raw("parameters"), r.opt("strict", "bool")
    )


def _parse(value: Any) -> dict:
    r = Reader(value, "struct ResponsesRequest")
    q: dict[str, Any] = {"model": r.req("model", "str")}
    inp = r.raw("input")
    if inp is not None:
        if type(inp) is str:
            pass
        elif type(inp) is list:
            inp = [_item(x) for x in inp]
        else:
            raise SchemaError("input should be a string or a list of input items")
    q["input"] = inp
    q["instructions"] = r.opt("instructions", "str")
    q["max_output_tokens"] = r.opt("max_output_tokens", "uint", 32)
    reasoning = r.raw("reasoning")
    q["effort"] = None
    q["reasoning_raw"] = None
    if reasoning is not None:
        rr = Reader(reasoning, "struct ResponsesReasoningConfig")
        q["effort"] = rr.opt_variant("effort", C.REQUEST_EFFORTS)
        summary = rr.raw("summary")
        gen = rr.raw("generate_summary")
        for s in (summary, gen):
            if s is not None:
                variant(s, ("auto", "concise", "detailed"))
        q["reasoning_raw"] = {"effort": q["effort"], "summary": summary if summary is not None else gen}
    q["stream"] = r.opt("stream", "bool")
    q["temperature"] = r.opt("temperature", "f32")
    text = r.raw("text")
    q["text_raw"] = None
    fmt = ("text",)
    if text is not None:
        tr = Reader(text, "struct ResponsesTextConfig")
        f = tr.raw("format")
        if f is not None:
            k = tagged(
                f,
                "type",
                ("text", "json_schema", "json_object"),
                "internally tagged enum ResponsesTextFormat",
            )
            fr = Reader(f, "struct")
            if k == "json_schema":
                fmt = (
                    "json_schema",
                    fr.req("name", "str"),
                    fr.required("schema"),
                    fr.opt("description", "str"),
                    fr.opt("strict", "bool"),
                )
            else:
                fmt = (k,)
        verbosity = tr.raw("verbosity")
        if verbosity is not None:
            variant(verbosity, ("low", "medium", "high"))
        q["text_raw"] = {"format": f, "verbosity": verbosity}
    q["format"] = fmt
    tc = r.raw("tool_choice")
    if tc is not None:
        if tc in ("none", "auto", "required"):
            pass
        elif type(tc) is dict and "type" in tc:
            k = tagged(
                tc,
                "type",
                ("function", "web_search", "web_search_2025_08_26", "custom"),
                "internally tagged enum",
            )
            tc = (
                "named",
                k,
                Reader(tc, "struct").req("name", "str") if k in ("function", "custom") else None,
            )
        else:
            raise SchemaError("expected one of `none`, `auto`, `required` or a tool choice object")
    q["tool_choice"] = tc
    q["tool_choice_raw"] = copy.deepcopy(r.raw("tool_choice"))
    tools = r.opt("tools", "list")
    q["tools"] = None if tools is None else [_tool(t) for t in tools]
    q["tools_raw"] = copy.deepcopy(tools)
    q["top_logprobs"] = r.opt("top_logprobs", "uint", 8)
    q["top_p"] = r.opt("top_p", "f32")
    q["top_p_raw"] = r.raw("top_p")
    q["temperature_raw"] = r.raw("temperature")
    q["user"] = r.opt("user", "str")
    return q


def _format_echo(fmt: tuple) -> dict:
    if fmt[0] == "json_schema":
        return {
            "type": "json_schema",
            "name": fmt[1],
            "schema": copy.deepcopy(fmt[2]),
            "description": fmt[3],
            "strict": fmt[4],
        }
    return {"type": fmt[0]}


def _tool_choice_echo(tc: Any) -> Any:
    if isinstance(tc, tuple):
        if tc[1] in ("function", "custom"):
            return {"type": tc[1], "name": tc[2]}
        return {"type": tc[1]}
    return tc


def _function_echo(raw: dict) -> dict:
    return {
        "type": "function",
        "name": raw.get("name"),
        "description": raw.get("description"),
        "parameters": copy.deepcopy(raw.get("parameters")),
        "strict": raw.get("strict"),
    }


def _tool_echo(raw: dict) -> dict:
    t = raw["type"]
    if t == "function":
        return _function_echo(raw)
    if t in ("web_search", "web_search_2025_08_26"):
        loc = raw.get("user_location")
        if loc is not None:
            loc = {k: loc.get(k) for k in ("city", "country", "region", "timezone")}
        return {"type": t, "search_context_size": raw.get("search_context_size"), "user_location": loc}
    if t == "namespace":
        inner = [
            _function_echo(x) if x.get("type") == "function" else {"type": "custom", "name": x.get("name")}
            for x in raw.get("tools") or []
        ]
        return {
            "type": "namespace",
            "name": raw.get("name"),
            "description": raw.get("description"),
            "tools": inner,
        }
    if t == "custom":
        return {"type": "custom", "name": raw.get("name")}
    return {
        "type": "tool_search",
        "execution": raw.get("execution"),
        "description": raw.get("description"),
        "parameters": copy.deepcopy(raw.get("parameters")),
    }


class _ToolSet:
    def __init__(self, tools, options: ConversionOptions, mv: ModelVersion) -> None:
        self.client: list[C.ClientTool] = []
        self.namespace_tools: list[tuple[str, tuple[str, str]]] = []
        self.mv = mv
        tools = tools or []
        self.top_level = {t[1].name for t in tools if t[0] == "function"}
        for index, t in enumerate(tools):
            path = f"tools[{index}]"
            if t[0] == "function":
                C.validate_tool_name(t[1].name, path)
                self.client.append(t[1])
            elif t[0] == "namespace":
                _, name, description, inner = t
                C.validate_tool_name(name, path)
                seen: set[str] = set()
                for ii, it in enumerate(inner):
                    if it[0] == "custom":
                        raise ConversionError(
                            f"Currently custom tools are not allowed inside a namespace. Found custom tool '{it[1]}' in "
                            f"{path}.tools[{ii}]."
                        )
                    fn = copy.copy(it[1])
                    C.validate_tool_name(fn.name, f"{path}.tools[{ii}]")
                    if fn.name in seen:
                        raise ConversionError("Tool names within a namespace must be unique.")
                    seen.add(fn.name)
                    if mv is ModelVersion.DeepseekV41Flash and description:
                        fn.description = f"{description}\n{fn.description or ''}"
                    full = self._unique(_join_namespace(name, fn.name, mv), self.is_taken)
                    self.namespace_tools.append((full, (name, fn.name)))
                    fn.name = full
                    self.client.append(fn)
            elif t[0] == "custom":
                if t[1] != "apply_patch":
                    raise ConversionError(
                        f"Unsupported custom tool: '{t[1]}'. Only 'apply_patch' is supported."
                    )
                # The reference accepts `apply_patch` (a fixed tool description plus a custom-input
                # output stream); this package does not implement it yet and says so.
                raise ConversionError(
                    "Custom tool 'apply_patch' is not supported by the pure-Python deepseek-recipe."
                )
            elif t[0] == "web_search":
                if options.responses_web_search.value == "reject":
                    raise ConversionError("Server tools are not supported")

    def is_taken(self, candidate: str) -> bool:
        return candidate in self.top_level or any(n == candidate for n, _ in self.namespace_tools)

    @staticmethod
    def _unique(base: str, taken) -> str:
        if not taken(base):
            return base
        i = 1
        while taken(f"{base}_{i}"):
            i += 1
        return f"{base}_{i}"

    def convert_call(self, item: dict, historical: dict) -> ToolCall:
        name = item["name"]
        if item["namespace"] is not None:
            key = (item["namespace"], item["name"])
            registered = next((n for n, k in self.namespace_tools if k == key), None)
            if registered is not None:
                name = registered
            elif key in historical:
                name = historical[key]
            else:
                name = self._unique(
                    _join_namespace(key[0], key[1], self.mv),
                    lambda c: self.is_taken(c) or c in historical.values(),
                )
                historical[key] = name
        return ToolCall(item["call_id"], name, item["arguments"])


def _join_namespace(namespace: str, name: str, mv: ModelVersion) -> str:
    if mv is ModelVersion.DeepseekV41Flash:
        return f"{namespace}::{name}"
    if namespace.endswith("_") or name.startswith("_"):
        return f"{namespace}{name}"
    return f"{namespace}__{name}"


class _Converter:
    def __init__(self, image_token: str, mv: ModelVersion) -> None:
        self.image_token = image_token
        self.mv = mv

    def push_image(self, image: tuple, path: str, item_path: str, parts: list, sources: list) -> None:
        if not self.mv.supports_image():
            parts.append(Prompt.plain(C.UNSUPPORTED_IMAGE_PLACEHOLDER))
            return
        p = Prompt()
        p.push_special(self.image_token)
        parts.append(p)
        url, detail, file_id = image
        url = url or None
        if url is None and file_id is None:
            raise ConversionError(f"{path}: input_image must have image_url or file_id")
        if url is not None and file_id is not None:
            raise ConversionError(f"{path}: input_image cannot have both image_url and file_id")
        if url is None:
            raise C.file_id_unsupported(path)
        sources.append(
            C.image_url_source(
                url,
                detail,
                item_path,
                lambda n: (
                    f"{path}: image_url external link length {n} too long, max link length {C.MAX_IMAGE_URL_LEN}. "
                    "Consider passing file data directly with base64 data url instead."
                ),
            )
        )

    def message_content(self, content: Any, item_path: str):
        if type(content) is str:
            return Prompt.plain(content), []
        parts: list[Prompt] = []
        sources: list = []
        for bi, b in enumerate(content):
            if b[0] in ("input_text", "output_text"):
                parts.append(Prompt.plain(b[1]))
            elif b[0] == "input_image":
                self.push_image(b[1], f"{item_path}.content[{bi}]", item_path, parts, sources)
            else:
                parts.append(Prompt.plain(C.UNSUPPORTED_DOCUMENT_PLACEHOLDER))
        return C.join_paragraphs(parts), sources

    def output_content(self, output: Any, item_path: str):
        if type(output) is str:
            content, sources = Prompt.plain(output), []
        else:
            parts: list[Prompt] = []
            sources = []
            for oi, b in enumerate(output):
                if b[0] == "input_text":
                    parts.append(Prompt.plain(b[1]))
                elif b[0] == "input_image":
                    self.push_image(b[1], f"{item_path}.output[{oi}]", item_path, parts, sources)
                else:
                    parts.append(Prompt.plain(C.UNSUPPORTED_DOCUMENT_PLACEHOLDER))
            content = C.join_paragraphs(parts)
        C.validate_data_url_sources(sources, item_path)
        return content, sources


def _resize_notice(item: dict) -> str | None:
    if item.get("kind") != "message" or item["role"] != "developer":
        return None
    c = item["content"]
    if type(c) is not list or len(c) != 1 or c[0][0] != "input_text":
        return None
    text = c[0][1]
    return (
        text if text.startswith("<image_resize_notice>") and text.endswith("</image_resize_notice>") else None
    )


class _Group:
    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.outputs: dict[str, list] = {}

    def complete(self) -> bool:
        return len(self.outputs) >= len(self.calls)

    def append_to(self, messages: list) -> None:
        if not self.calls:
            return
        calls = sorted(self.calls, key=lambda c: c._id)
        results = []
        for c in calls:
            if c._id in self.outputs:
                results.extend(self.outputs.pop(c._id))
        if not (messages and isinstance(messages[-1], AssistantMessage)):
            messages.append(AssistantMessage("", None, None, False))
        last = messages[-1]
        if last._tool_calls is not None:
            last._tool_calls = last._tool_calls + calls
        else:
            last._tool_calls = calls
        messages.extend(results)


def _push_message(item: dict, index: int, messages: list, conv: _Converter) -> None:
    path = f"input[{index}]"
    content, sources = conv.message_content(item["content"], path)
    role = item["role"]
    if role == "developer" and not conv.mv.supports_mid_conversation_system():
        role = "user"
    if role in ("system", "developer"):
        C.validate_data_url_sources(sources, path)
        messages.append(SystemMessage._from_prompt(content, sources, _tools=None))
    elif role == "user":
        C.validate_data_url_sources(sources, path)
        messages.append(UserMessage._from_prompt(content, sources))
    else:
        if sources:
            raise ConversionError(f"{path}: Image in assistant message is unsupported")
        last = messages[-1] if messages else None
        if isinstance(last, AssistantMessage) and last._tool_calls is None:
            text = content.text()
            if text:
                if last._content:
                    last._content += "\n\n"
                last._content += text
        else:
            messages.append(AssistantMessage(content.text(), None, None, False))


def _push_reasoning(item: dict, messages: list) -> None:
    text = "\n".join(item["texts"] or [])
    if not text:
        return
    last = messages[-1] if messages else None
    if not (isinstance(last, AssistantMessage) and not last._content):
        messages.append(AssistantMessage("", None, None, False))
    last = messages[-1]
    last._reasoning_content = (
        text if last._reasoning_content is None else last._reasoning_content + "\n" + text
    )


def _transform_items(items: list, messages: list, tools: _ToolSet, conv: _Converter) -> None:
    if not items:
        raise ConversionError("Input items array must not be empty")
    pending: list[str] = []  # insertion-ordered set
    resolved: set[str] = set()
    group: list[_Group | None] = [None]
    historical: dict = {}

    def empty_id(i: int) -> ConversionError:
        return ConversionError(
            f"Invalid 'input[{i}].call_id': empty string. Expected a string with minimum length 1, but got an empty "
            "string instead."
        )

    def new_call(i: int, cid: str) -> None:
        if not cid:
            raise empty_id(i)
        if cid in pending or cid in resolved:
            raise ConversionError(f"Duplicate 'call_id': {cid}.")
        pending.append(cid)

    def resolve(i: int, cid: str) -> None:
        if not cid:
            raise empty_id(i)
        if cid not in pending:
            if cid in resolved:
                raise ConversionError(f"Duplicate tool output for call_id: {cid}.")
            raise ConversionError(f"No tool call found for tool output with call_id {cid}.")
        pending.remove(cid)
        resolved.add(cid)

    def no_pending() -> None:
        if pending:
            raise ConversionError(f"No tool output found for tool call {pending[0]}.")

    def flush() -> None:
        if group[0] is not None:
            g, group[0] = group[0], None
            g.append_to(messages)

    def push_call(call: ToolCall) -> None:
        if group[0] is None:
            group[0] = _Group()
        group[0].calls.append(call)

    def push_output(cid: str, output: list) -> None:
        if group[0] is None:
            messages.extend(output)
            return
        group[0].outputs[cid] = output
        if group[0].complete():
            flush()

    i = 0
    n = len(items)
    while i < n:
        item = items[i]
        index = i
        i += 1
        kind = item["kind"]
        if kind == "message":
            no_pending()
            flush()
            _push_message(item, index, messages, conv)
        elif kind == "reasoning":
            no_pending()
            flush()
            _push_reasoning(item, messages)
        elif kind == "function_call":
            new_call(index, item["call_id"])
            push_call(tools.convert_call(item, historical))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if item["output"] is None:
                content, sources = Prompt(), []
            else:
                content, sources = conv.output_content(item["output"], f"input[{index}]")
            cid = item["call_id"]
            if cid is None:
                no_pending()
                flush()
                messages.append(ToolMessage._from_prompt(content, sources, _tool_call_id=None))
                continue
            resolve(index, cid)
            output = [ToolMessage._from_prompt(content, sources, _tool_call_id=cid)]
            if conv.mv is ModelVersion.DeepseekV41Flash and i < n:
                notice = _resize_notice(items[i])
                if notice is not None:
                    i += 1
                    output.append(SystemMessage._from_prompt(Prompt.plain(notice), [], _tools=None))
            push_output(cid, output)
        elif kind == "custom_tool_call":
            new_call(index, item["call_id"])
            push_call(ToolCall(item["call_id"], item["name"], _json.dumps_compact({"input": item["input"]})))
        elif kind == "web_search_call":
            no_pending()
            flush()
    flush()
    no_pending()


class ResponsesRequest(C.ProtocolRequest):
    """An OpenAI Responses request (dict, JSON str or bytes)."""

    _parse_request = staticmethod(_parse)

    def echo(self) -> ResponsesEcho:
        """The request settings that responses report (read them before `convert`)."""
        self._live()
        return self._echo()

    def _echo(self) -> ResponsesEcho:
        q = self._req
        e = ResponsesEcho()
        e._instructions = q["instructions"]
        e._max_output_tokens = q["max_output_tokens"]
        if q["reasoning_raw"] is not None:
            e._reasoning = dict(q["reasoning_raw"])
        e._temperature = 1.0 if q["temperature"] is None else q["temperature_raw"]
        if q["text_raw"] is not None:
            e._text = {"format": _format_echo(q["format"]), "verbosity": q["text_raw"]["verbosity"]}
        if q["tool_choice_raw"] is not None:
            e._tool_choice = _tool_choice_echo(q["tool_choice"])
        e._tools = [
            _tool_echo(raw) for raw, t in zip(q["tools_raw"] or [], q["tools"] or []) if t[0] != "unsupported"
        ]
        e._top_logprobs = q["top_logprobs"] or 0
        e._top_p = 1.0 if q["top_p"] is None else q["top_p_raw"]
        e._user = q["user"]
        return e

    def namespace_tool_map(self, options: ConversionOptions | None = None) -> dict[str, tuple[str, str]]:
        options = ConversionOptions() if options is None else options
        self._live()
        mv = options.resolve_model_version(self._req["model"])
        tools = [t for t in (self._req["tools"] or []) if t[0] in ("function", "namespace")]
        return {n: k for n, k in _ToolSet(tools, options, mv).namespace_tools}

    def convert(self, options: ConversionOptions | None = None) -> C.ConversationRequest:
        options = self._consume(options)
        q = self._req
        mv = options.resolve_model_version(q["model"])
        thinking, effort = C.resolve_thinking_mode(options.default_thinking_mode, None, q["effort"])
        echo = self._echo()
        tool_set = _ToolSet(q["tools"], options, mv)
        conv = _Converter(options.special_tokens.image, mv)
        messages: list = []
        if q["instructions"]:
            messages.append(SystemMessage._from_prompt(Prompt.plain(q["instructions"]), [], _tools=None))
        inp = q["input"]
        if type(inp) is str:
            messages.append(UserMessage._from_prompt(Prompt.plain(inp), []))
        elif inp is not None:
            _transform_items(inp, messages, tool_set, conv)
        elif not messages:
            raise ConversionError("Either input or instructions must be provided")
        try:
            C.normalize_reasoning_content(
                messages,
                thinking,
                bool(tool_set.client),
                options.reasoning_content_behavior.value == "reject",
            )
        except ConversionError:
            raise ConversionError(
                "The `reasoning_text` in the thinking mode must be passed back to the API."
            ) from None
        ro = C.ResponseOptions(
            namespace_tool_map={n: k for n, k in tool_set.namespace_tools}, responses_echo=echo
        )
        tc = q["tool_choice"]
        if isinstance(tc, tuple) and tc[1] in ("web_search", "web_search_2025_08_26"):
            if options.responses_web_search.value == "reject":
                raise ConversionError("Server tools are not supported")
            tc = None
        if tc == "none":
            tools, tool_choice = [], "none"
        elif not tool_set.client:
            tools, tool_choice = [], "auto"
        else:
            if isinstance(tc, tuple):
                choice: Any = ("named", tc[2])
            elif tc == "required":
                choice = "required"
            else:
                choice = "auto"
            tools, tool_choice = C.convert_client_tools(tool_set.client, choice, thinking)
        fmt = q["format"]
        conv_kw: dict[str, Any] = {}
        if fmt[0] == "json_schema":
            constraint = ("json_schema", C.validate_response_schema(fmt[2], fmt[4]))
            conv_kw["response_schema"] = fmt[2]
        elif fmt[0] == "json_object":
            if not C.contains_json_instruction(messages):
                raise ConversionError(
                    "Response input messages must contain the word 'json' in some form to use 'text.format' of type "
                    "'json_object'."
                )
            constraint = ("json_object",)
            conv_kw["response_format"] = "json_object"
        else:
            constraint = ("text",)
        oc = C.resolve_output_constraint(tools, tool_choice, constraint, fmt[0] != "text")
        io = C.inference_options(
            thinking_mode=thinking,
            upper_bound=options.resolve_max_tokens_upper_bound(thinking),
            temperature=q["temperature"],
            top_p=q["top_p"],
            logprobs=None if q["top_logprobs"] is None else True,
            top_logprobs=q["top_logprobs"],
            max_tokens=q["max_output_tokens"],
        )
        parse_tool_calls = bool(tools) and tool_choice != "none"
        io["top_p"] = mv.resolve_top_p(q["top_p"], thinking, parse_tool_calls)
        parsing = ParsingOptions(
            parse_tool_calls=parse_tool_calls,
            starts_in_tool_calls=tool_choice == "required",
            parse_json_output=fmt[0] == "json_object",
            thinking_initial_stage=ThinkingInitialStage.ReasoningStart if thinking else None,
            special_tokens=options.special_tokens,
        )
        conversation = Conversation(
            messages,
            thinking_mode=thinking,
            tools=tools,
            tool_choice=tool_choice,
            reasoning_effort=effort,
            **conv_kw,
        )
        return C.ConversationRequest._build(
            conversation, InferenceOptions(**io, output_constraint=oc), parsing, mv, q["stream"] is True, ro
        )

    @staticmethod
    def chunk_generator(request: C.ConversationRequest, id: str, model: str):  # noqa: A002 - official name
        from ..responses.responses import ResponsesChunkGenerator

        return ResponsesChunkGenerator(
            id, model, request.conversation.thinking_mode, request._response_options
        )
