"""Fuzz every public entry point with garbage; only the documented error types may come out.

The contract (README "Errors"): request constructors raise ValueError (TypeError only for a body that is
not str/bytes/dict), `convert` and `resolve_max_tokens` raise ConversionError, prompt encoding and the
tokenizer raise RuntimeError, `StreamProcessor.push/finish` raise RuntimeError, and the constructors of
conversation objects, options, chunks and responses raise ValueError for bad values and TypeError for
arguments of the wrong Python type. A leaked UnicodeError or RecursionError is a failure even where its
base class (ValueError / RuntimeError) is allowed, and every error message and every emitted chunk must
encode as UTF-8 (an engine writes them to a socket).

Examples per test: $DEEPSEEK_RECIPE_FUZZ_EXAMPLES (default 30, to keep CI fast); a long run is e.g.
`DEEPSEEK_RECIPE_FUZZ_EXAMPLES=20000 pytest packages/deepseek-recipe/tests/test_fuzz.py
--hypothesis-show-statistics` (the statistics give the exact number of inputs per test).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from contextlib import contextmanager

import deepseek_recipe as dr
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from recipe_testing import golden_cases, request_class

EXAMPLES = int(os.environ.get("DEEPSEEK_RECIPE_FUZZ_EXAMPLES", "30"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
APIS = ("chat_completions", "messages", "responses")
# Leaks that subclass an allowed type but are never the documented error.
LEAKS = (UnicodeError, RecursionError)


class NotDocumented(AssertionError):
    pass


@contextmanager
def only(*allowed: type[BaseException], where: str):
    """Let through nothing but `allowed` errors (never a LEAK), each with a UTF-8-encodable message."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, LEAKS) or not isinstance(exc, allowed):
            raise NotDocumented(f"{where}: undocumented {type(exc).__name__}: {exc!r}") from exc
        _encodable(str(exc), f"{where}: message of {type(exc).__name__}")
        if isinstance(exc, dr.ConversionError):
            _encodable(exc.body, f"{where}: ConversionError.body")
            json.loads(exc.body)
        raise


def attempt(fn, *allowed: type[BaseException], where: str):
    """`fn()` or None when it raised one of the documented `allowed` errors."""
    try:
        with only(*allowed, where=where):
            result = fn()
    except NotDocumented:
        raise
    except allowed as exc:
        # Outcome counts (shown by --hypothesis-show-statistics) tell which error classes the run reached.
        message = str(exc)
        kind = next((k for k in _KINDS if k in message), "other")
        event(f"{where}: {type(exc).__name__} ({kind})")
        return None
    event(f"{where}: ok")
    return result


_KINDS = ("lone surrogate", "recursion limit", "nesting depth", "not a JSON value", "must be a")


def _encodable(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise NotDocumented(f"{where} is not valid Unicode: {text!r}") from exc


# -- value strategies ------------------------------------------------------------------------

_PIECES = [
    "<think>",
    "</think>",
    "<｜User｜>",
    "｜DSML｜",
    "<｜DSML｜",
    '"',
    "{",
    "[",
    "\\",
    "é",
    "😀",
    "\n",
    "END",
]
_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
# Strings that stress a consumer: nesting for regex parsers (schema `pattern`), long runs, markup.
_BOMBS = ["(" * 600 + ")" * 600, "[" * 300, "\\u" * 50, "{" * 200 + "}" * 200, "<｜DSML｜" * 40]
text = st.one_of(
    st.text(max_size=8),
    st.sampled_from(_BOMBS),
    st.text(st.characters(exclude_categories=()), max_size=8),  # lone surrogates included
    st.lists(st.one_of(st.sampled_from(_PIECES), _SURROGATE, st.text(max_size=3)), max_size=5).map("".join),
)
clean_text = st.lists(st.sampled_from(["a", "END", " ", "\n", "</think>", "é", "😀"]), max_size=4).map("".join)
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2**63, 2**64, -(2**63) - 1, 1e999, 0.5, 10**400]),
)
leaves = st.one_of(st.none(), st.booleans(), numbers, text)
json_like = st.recursive(
    leaves,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(text, kids, max_size=3)),
    max_leaves=10,
)


def nest(value, depth: int, kind: str):
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


deep = st.builds(
    nest, json_like, st.sampled_from([126, 127, 128, 129, 130, 1000, 5000]), st.sampled_from(["list", "dict"])
)
non_json = st.one_of(
    st.builds(object),
    st.binary(max_size=4),
    st.sets(st.integers(), max_size=2),
    st.complex_numbers(max_magnitude=10),
    st.dictionaries(st.integers(), leaves, min_size=1, max_size=2),
    st.tuples(leaves, leaves),
)
garbage = st.one_of(json_like, deep, non_json)


def cyclic():
    node: dict = {"a": []}
    node["a"].append(node)
    return node


# -- request bodies: golden-corpus requests (plus built-in seeds), mutated ----------------------

_BUILTIN_SEEDS = {
    "chat_completions": [
        {
            "model": "DeepSeek-V4-Pro",
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
                    },
                }
            ],
            "stop": ["END"],
            "response_format": {"type": "text"},
        }
    ],
    "messages": [
        {
            "model": "DeepSeek-V4.1-Flash",
            "max_tokens": 100,
            "system": "s",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
            "stop_sequences": ["END"],
        }
    ],
    "responses": [
        {
            "model": "DeepSeek-V4.1-Flash",
            "instructions": "be brief",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
        }
    ],
}


def _seeds() -> dict[str, list[dict]]:
    seeds = {api: list(bodies) for api, bodies in _BUILTIN_SEEDS.items()}
    for name in ("render.jsonl", "errors.jsonl", "parse.jsonl"):
        for case in golden_cases(name):
            if case.get("api") in seeds and isinstance(case.get("request"), dict):
                seeds[case["api"]].append(case["request"])
    return seeds


SEEDS = _seeds()


def _slots(value, out: list) -> list:
    """Every (container, key) slot of a JSON value."""
    stack = [value]
    while stack:
        v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            out.append((v, k))
            stack.append(x)
    return out


@st.composite
def mutated_body(draw, api: str):
    body = copy.deepcopy(draw(st.sampled_from(SEEDS[api])))
    for _ in range(draw(st.integers(0, 3))):
        slots = _slots(body, [])
        if not slots:
            break
        container, key = draw(st.sampled_from(slots))
        op = draw(st.sampled_from(["replace", "delete", "surrogate", "deep", "strings"]))
        if op == "delete":
            del container[key]
        elif op == "surrogate" and isinstance(container[key], str):
            s = container[key]
            i = draw(st.integers(0, len(s)))
            container[key] = s[:i] + draw(_SURROGATE) + s[i:]
        elif op == "deep":
            container[key] = draw(deep)
        elif op == "strings":
            container[key] = draw(text)
        else:
            container[key] = draw(garbage)
    return body


def _as_text(body, how: str):
    if how == "dict":
        return body
    try:
        s = json.dumps(body, ensure_ascii=how == "ascii")
    except (TypeError, ValueError, RecursionError):
        return body  # not representable as JSON text: hand over the Python value
    return s.encode("utf-8", "surrogatepass") if how == "bytes" else s


@functools.cache
def tokenizer():
    return dr.Tokenizer.deepseek_v4()


# -- streaming helpers ----------------------------------------------------------------------


@st.composite
def chunks(draw):
    out = []
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["text", "tokens", "ready", "finish", "garbage_tokens", "mutated_text"]))
        if kind == "text":
            out.append(
                ("text", draw(text), draw(st.one_of(st.integers(0, 5), st.integers(-2, -1), st.none())))
            )
        elif kind == "tokens":
            ids = draw(st.lists(st.one_of(st.integers(0, 129_300), st.integers(-3, 2**33)), max_size=8))
            lps = draw(
                st.one_of(st.none(), st.just("match"), st.lists(st.tuples(numbers, st.just([])), max_size=2))
            )
            if lps == "match":
                lps = [(draw(numbers), [(ids[0] if ids else 0, draw(numbers))]) for _ in ids]
            out.append(("tokens", ids, lps))
        elif kind == "garbage_tokens":
            out.append(("tokens", draw(st.lists(garbage, max_size=3)), None))
        elif kind == "ready":
            out.append(("ready", draw(st.one_of(st.none(), text)), draw(st.integers(-1, 50))))
        elif kind == "finish":
            out.append(("finish", draw(st.sampled_from(list(dr.InferenceFinishReason))), None))
        else:
            out.append(("mutated_text", draw(text), None))
    return out


def _make_chunk(spec):
    kind, a, b = spec
    if kind == "text":
        return dr.InferenceChunk.text(a) if b is None else dr.InferenceChunk.text(a, b)
    if kind == "tokens":
        return dr.InferenceChunk.tokens(a, b)
    if kind == "ready":
        return dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=b), system_fingerprint=a)
    if kind == "finish":
        return dr.InferenceChunk.finish(a)
    chunk = dr.InferenceChunk.text("x")
    chunk.content = a  # chunk fields are assignable: push checks them again
    return chunk


def run_stream(api: str, request, options, spec, *, rid="r", model="m", with_tokenizer=True) -> None:
    """Drive a processor with `spec` chunks; push/finish may raise only RuntimeError."""
    cls = request_class(api)
    gen = attempt(
        lambda: cls.chunk_generator(request, rid, model), ValueError, TypeError, where="chunk_generator"
    )
    if gen is None:
        return
    tok = tokenizer() if with_tokenizer else None
    proc = attempt(
        lambda: dr.StreamProcessor(gen, options, tok), ValueError, TypeError, where="StreamProcessor"
    )
    if proc is None:
        return
    response = {
        "chat_completions": dr.ChatCompletionResponse,
        "messages": dr.MessagesResponse,
        "responses": dr.ResponsesResponse,
    }[api](rid, model, 0)
    for s in spec:
        if proc.finished:
            break
        chunk = attempt(lambda s=s: _make_chunk(s), ValueError, TypeError, where=f"InferenceChunk {s[0]}")
        if chunk is None:
            continue
        outs = attempt(lambda c=chunk: proc.push(c), RuntimeError, where="StreamProcessor.push")
        if outs is None:
            return  # a stream error closes the processor
        _consume(response, outs)
    outs = attempt(proc.finish, RuntimeError, where="StreamProcessor.finish")
    if outs is not None:
        _consume(response, outs)
    _strict_json(response.to_json(), "accumulated response")


def _strict_json(text: str, where: str) -> None:
    """`text` is UTF-8-encodable RFC 8259 JSON (no bare NaN / Infinity)."""
    _encodable(text, where)

    def reject(name):
        raise NotDocumented(f"{where} holds the non-JSON number {name}: {text[:200]!r}")

    json.loads(text, parse_constant=reject)


def _consume(response, outs) -> None:
    for out in outs:
        _strict_json(out.to_json(), "protocol chunk")
        type(response).sse_event_name(out)
        response.accumulate(out)


# -- the fuzz tests -------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), api=st.sampled_from(APIS), how=st.sampled_from(["dict", "raw", "ascii", "bytes"]))
def test_fuzz_requests_convert_render_encode_stream(data, api, how):
    body = _as_text(data.draw(mutated_body(api)), how)
    cls = request_class(api)
    req = attempt(lambda: cls(body), ValueError, where=f"{cls.__name__}(body)")
    if req is None:
        return
    model = req.model
    conv = attempt(lambda: req.convert(dr.ConversionOptions()), dr.ConversionError, where="convert")
    if conv is None:
        return
    rendered = attempt(
        lambda: conv.encoding().render_conversation(conv.conversation), where="render_conversation"
    )
    _encodable(rendered.prompt, "rendered prompt")
    ids = attempt(
        lambda: conv.encoding().with_tokenizer(tokenizer()).encode(conv.conversation),
        RuntimeError,
        where="encode",
    )
    n = len(ids) if ids is not None else data.draw(st.integers(0, 2**32))
    attempt(
        lambda: conv.resolve_max_tokens(n, data.draw(st.integers(0, 2**20))),
        dr.ConversionError,
        ValueError,
        where="resolve_max_tokens",
    )
    for field in ("prompt", "special_ranges"):
        getattr(rendered, field)
    _encodable(json.dumps(conv.conversation.to_dict(), ensure_ascii=False), "converted conversation")
    _encodable(json.dumps(conv.inference_options.to_dict(), ensure_ascii=False), "inference options")
    run_stream(api, conv, conv.parsing_options, data.draw(chunks()), model=model)


@FUZZ
@given(
    api=st.sampled_from(APIS),
    body=st.one_of(
        st.binary(max_size=40),
        text,
        st.builds(
            lambda s, i, c: s[:i] + c + s[i:],
            st.sampled_from(['{"model": "m", "messages": []}', "[1]", "{}"]),
            st.integers(0, 30),
            st.one_of(text, st.sampled_from(["\\ud800", "\\udc00", '"\\ud800"', "1e999"])),
        ),
        st.builds(
            lambda n, kind: ('{"model": "m", "messages": ' + "[" * n + "]" * n + "}") if kind else "[" * n,
            st.sampled_from([126, 127, 128, 129, 2000, 100_000]),
            st.booleans(),
        ),
        garbage,
        st.just(None),
    ),
)
def test_fuzz_request_text_and_types(api, body):
    cls = request_class(api)
    allowed = (ValueError,) if isinstance(body, (str, bytes, dict)) else (ValueError, TypeError)
    req = attempt(lambda: cls(body), *allowed, where=f"{cls.__name__}(body)")
    if req is not None:
        attempt(req.convert, dr.ConversionError, where="convert")


@st.composite
def conversation_args(draw):
    """Constructor arguments for messages and tools, mostly well-typed strings, sometimes garbage."""

    def maybe(good):
        return st.one_of(good, good, good, garbage)

    def opt(good):
        return st.one_of(st.none(), maybe(good))

    msgs = []
    for _ in range(draw(st.integers(0, 4))):
        role = draw(st.sampled_from(["system", "user", "assistant", "tool", "reminder", "junk"]))
        if role in ("system", "reminder"):
            msgs.append((role, (draw(maybe(text)),)))
        elif role in ("user", "tool"):
            msgs.append((role, (draw(maybe(text)), draw(opt(text)))))
        elif role == "assistant":
            calls = draw(st.lists(st.tuples(maybe(text), maybe(text), maybe(text)), max_size=2))
            msgs.append((role, (draw(maybe(text)), draw(opt(text)), calls, draw(st.booleans()))))
        else:
            msgs.append((role, (draw(garbage),)))
    tools = [
        (
            draw(maybe(text)),
            draw(opt(text)),
            draw(st.one_of(json_like, garbage, st.builds(cyclic))),
            draw(st.sampled_from([None, True, False, "yes"])),
        )
        for _ in range(draw(st.integers(0, 2)))
    ]
    kwargs = {
        "thinking_mode": draw(st.booleans()),
        "tool_choice": draw(maybe(st.sampled_from(["auto", "none", "required"]))),
        "reasoning_effort": draw(maybe(st.sampled_from([None, "low", "high", "xhigh", "max"]))),
        "response_format": draw(maybe(st.sampled_from(["text", "json_object"]))),
        "response_schema": draw(st.one_of(st.none(), json_like, deep)),
        "response_regex": draw(st.one_of(st.none(), text)),
    }
    return msgs, tools, kwargs


def _message(role: str, args: tuple):
    if role == "system":
        return dr.SystemMessage(*args)
    if role == "reminder":
        return dr.LatestReminderMessage(*args)
    if role == "user":
        return dr.UserMessage(args[0], [dr.UrlImageSource("http://x")], image_token=args[1])
    if role == "tool":
        return dr.ToolMessage(*args)
    if role == "assistant":
        content, reasoning, calls, prefix = args
        return dr.AssistantMessage(content, reasoning, [dr.ToolCall(*c) for c in calls], prefix=prefix)
    return args[0]  # not a Message at all


@FUZZ
@given(args=conversation_args(), v41=st.booleans())
def test_fuzz_conversation_render_encode(args, v41):
    msgs, tools, kwargs = args
    built = [attempt(lambda m=m: _message(*m), ValueError, TypeError, where=f"{m[0]} message") for m in msgs]
    defs = [
        attempt(lambda t=t: dr.ToolDefinition(*t), ValueError, TypeError, where="ToolDefinition")
        for t in tools
    ]
    conv = attempt(
        lambda: dr.Conversation(
            [m for m in built if m is not None], tools=[d for d in defs if d is not None], **kwargs
        ),
        ValueError,
        TypeError,
        where="Conversation",
    )
    if conv is None:
        return
    enc = dr.DeepseekV41Encoding() if v41 else dr.DeepseekV4Encoding()
    rendered = attempt(lambda: enc.render_conversation(conv), where="render_conversation")
    _encodable(rendered.prompt, "rendered prompt")
    attempt(lambda: enc.with_tokenizer(tokenizer()).encode(conv), RuntimeError, where="encode")


@FUZZ
@given(
    value=st.one_of(text, garbage),
    ranges=st.lists(st.tuples(st.integers(-2, 20), st.integers(-2, 20)), max_size=3),
    ids=st.lists(st.integers(-(2**40), 2**40), max_size=6),
)
def test_fuzz_tokenizer(value, ranges, ids):
    tok = tokenizer()
    allowed = (RuntimeError,) if isinstance(value, str) else (RuntimeError, TypeError)
    for name in ("encode", "encode_plain", "count_tokens"):
        attempt(lambda name=name: getattr(tok, name)(value), *allowed, where=f"Tokenizer.{name}")
    attempt(lambda: tok.encode_prompt(value, ranges), *allowed, where="Tokenizer.encode_prompt")
    _encodable(tok.decode(ids), "Tokenizer.decode")
    attempt(lambda: dr.Tokenizer.from_str(value), *allowed, where="Tokenizer.from_str")
    if isinstance(value, str) and "\x00" not in value:
        path = os.path.join("/nonexistent-recipe-fuzz", value.replace("/", "_"))
        attempt(lambda: dr.Tokenizer.from_file(path), RuntimeError, where="Tokenizer.from_file")


@FUZZ
@given(
    api=st.sampled_from(APIS),
    # Mostly valid settings, so that most examples get as far as streaming.
    stops=st.one_of(
        st.lists(clean_text, max_size=3), st.lists(clean_text, max_size=3), st.lists(text), garbage
    ),
    specials=st.dictionaries(
        st.sampled_from(["thinking_end", "dsml", "eos"]), st.one_of(clean_text, text, garbage), max_size=1
    ),
    flags=st.tuples(
        st.booleans(), st.booleans(), st.booleans(), st.sampled_from([None, *dr.ThinkingInitialStage])
    ),
    ids=st.one_of(st.just(("r", "m")), st.just(("r", "m")), st.tuples(st.one_of(text, garbage), text)),
    spec=chunks(),
    with_tokenizer=st.booleans(),
    late_surrogate=st.booleans(),
)
def test_fuzz_parsing_options_and_stream(
    api, stops, specials, flags, ids, spec, with_tokenizer, late_surrogate
):
    tokens = attempt(lambda: dr.SpecialTokens(**specials), ValueError, TypeError, where="SpecialTokens")
    if tokens is None:
        return
    tools, starts_in, json_out, stage = flags
    options = attempt(
        lambda: dr.ParsingOptions(
            parse_tool_calls=tools,
            starts_in_tool_calls=starts_in,
            parse_json_output=json_out,
            thinking_initial_stage=stage,
            stop_sequences=stops,
            special_tokens=tokens,
        ),
        ValueError,
        TypeError,
        where="ParsingOptions",
    )
    if options is None:
        return
    request = request_class(api)(_BUILTIN_SEEDS[api][0]).convert()
    # Options are mutable: a value assigned after construction is checked when the processor is built.
    if late_surrogate:
        options.stop_sequences = [*options.stop_sequences, "\ud800"]
    run_stream(api, request, options, spec, rid=ids[0], model=ids[1], with_tokenizer=with_tokenizer)


@FUZZ
@given(
    upper=st.one_of(st.integers(-5, 2**33), garbage),
    alias=st.tuples(st.one_of(text, garbage), st.sampled_from([*dr.ModelVersion, "x"])),
    tokens=st.tuples(st.one_of(st.integers(-5, 2**33), garbage), st.one_of(st.integers(-5, 2**33), garbage)),
)
def test_fuzz_conversion_options_and_resolve(upper, alias, tokens):
    attempt(
        lambda: dr.ConversionOptions(thinking_max_tokens_upper_bound=upper),
        ValueError,
        TypeError,
        where="ConversionOptions",
    )
    opts = attempt(
        lambda: dr.ConversionOptions().with_model_alias(*alias),
        ValueError,
        TypeError,
        where="with_model_alias",
    )
    if opts is not None:
        body = {"model": alias[0], "messages": [{"role": "user", "content": "q"}]}
        req = attempt(lambda: dr.ChatCompletionRequest(body), ValueError, where="ChatCompletionRequest")
        conv = (
            None if req is None else attempt(lambda: req.convert(opts), dr.ConversionError, where="convert")
        )
        if conv is not None:
            attempt(
                lambda: conv.resolve_max_tokens(*tokens),
                dr.ConversionError,
                ValueError,
                where="resolve_max_tokens",
            )


@pytest.mark.parametrize("api", APIS)
def test_seed_bodies_convert(api):
    # The built-in seeds are valid requests, so the mutations above start from a converting body.
    for body in _BUILTIN_SEEDS[api]:
        request_class(api)(body).convert()
