"""The error contract on the inputs that used to escape it: lone surrogates and deep nesting."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest
from recipe_testing import request_class

LONE = "\ud800"
BODIES = {
    "chat_completions": {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "hi"}]},
    "messages": {
        "model": "DeepSeek-V4-Pro",
        "max_tokens": 9,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "responses": {"model": "DeepSeek-V4-Pro", "input": [{"role": "user", "content": "hi"}]},
}
CONTENT_PATH = {
    "chat_completions": "messages[0].content",
    "messages": "messages[0].content",
    "responses": "input[0].content",
}


def _nest(depth: int, leaf="x"):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def _with_content(api: str, content):
    body = json.loads(json.dumps(BODIES[api]))
    (body["input"] if api == "responses" else body["messages"])[0]["content"] = content
    return body


@pytest.mark.parametrize("api", list(BODIES))
@pytest.mark.parametrize("form", ["dict", "text", "escaped"])
def test_lone_surrogate_in_a_request_is_a_value_error_naming_the_field(api, form):
    body = _with_content(api, f"a{LONE}b")
    if form != "dict":
        body = json.dumps(body, ensure_ascii=form == "escaped")  # escaped: the JSON text spells `\ud800`
    with pytest.raises(ValueError) as info:
        request_class(api)(body)
    message = str(info.value)
    assert not isinstance(info.value, UnicodeError)
    assert message.startswith("invalid request body:" if form == "dict" else "invalid JSON request:")
    assert f"the string at {CONTENT_PATH[api]} holds a lone surrogate U+D800 at index 1" in message
    message.encode("utf-8")  # the message itself is printable


def test_lone_surrogate_in_a_key_and_in_a_tool_name():
    body = dict(BODIES["chat_completions"], tools=[{"type": "function", "function": {"name": f"f{LONE}"}}])
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name holds a lone surrogate"):
        dr.ChatCompletionRequest(body)
    with pytest.raises(ValueError, match="a key of the object at <root> holds a lone surrogate"):
        dr.ChatCompletionRequest({**BODIES["chat_completions"], LONE: 1})
    with pytest.raises(ValueError, match="invalid JSON request: the key"):
        dr.ChatCompletionRequest('{"\\udc00": 1}')


@pytest.mark.parametrize("api", list(BODIES))
def test_request_nested_too_deep(api):
    # A Python body: at most 128 nested containers (the body object itself counts).
    with pytest.raises(ValueError, match=r"^invalid request body: .*maximum nesting depth of 128") as info:
        request_class(api)(_with_content(api, _nest(129)))
    assert not isinstance(info.value, RecursionError)
    # JSON text: serde_json's limit, the 128th nested array/object is rejected, with its position.
    text = "[" * 127 + "]" * 127
    with pytest.raises(ValueError, match="invalid type: sequence"):
        request_class(api)(text)  # parses, then fails the schema
    with pytest.raises(
        ValueError, match=r"^invalid JSON request: recursion limit exceeded at line 1 column 128 "
    ):
        request_class(api)("[" * 129 + "]" * 129)
    # The body object is level 1, so the 127th `[` (after 13 characters on line 2) is level 128.
    with pytest.raises(ValueError, match="recursion limit exceeded at line 2 column 140 "):
        request_class(api)('{"model": "m",\n "messages": ' + "[" * 200 + "]" * 200 + "}")
    with pytest.raises(ValueError, match="recursion limit exceeded"):
        request_class(api)("[" * 100_000)  # deeper than Python's own recursion limit
    # Read left to right like serde_json: too deep before a syntax error is the error reported.
    with pytest.raises(ValueError, match="recursion limit exceeded at line 1 column 128 "):
        request_class(api)("[" * 200 + "x")
    with pytest.raises(ValueError, match="expected value at line 1 column 21$"):
        request_class(api)("[" * 20 + "x")


def test_python_values_that_are_not_json_are_value_errors():
    base = BODIES["chat_completions"]
    for extra, needle in [
        ({"seed": 2**64}, "seed: integer 18446744073709551616 is outside the JSON number range"),
        ({"stop": {1: "x"}}, "stop: JSON object keys must be str, got int"),
        ({"stop": {"x"}}, "stop: set is not a JSON value"),
        ({"temperature": float("nan")}, "temperature: NaN is not a finite JSON number"),
    ]:
        with pytest.raises(ValueError) as info:
            dr.ChatCompletionRequest({**base, **extra})
        assert needle in str(info.value)


def test_conversation_objects_reject_lone_surrogates():
    cases = [
        (lambda: dr.UserMessage(LONE), "UserMessage.content"),
        (lambda: dr.SystemMessage("x", image_token=LONE), "image_token"),
        (lambda: dr.AssistantMessage("x", reasoning_content=LONE), "AssistantMessage.reasoning_content"),
        (lambda: dr.ToolMessage("x", LONE), "ToolMessage.tool_call_id"),
        (lambda: dr.LatestReminderMessage(LONE), "LatestReminderMessage.content"),
        (lambda: dr.ToolCall("id", LONE, "{}"), "ToolCall.name"),
        (lambda: dr.ToolDefinition(LONE), "ToolDefinition.name"),
        (lambda: dr.ToolDefinition("f", LONE), "ToolDefinition.description"),
        (
            lambda: dr.ToolDefinition("f", parameters={"d": LONE}),
            "ToolDefinition.parameters: the string at d",
        ),
        (lambda: dr.UrlImageSource(f"http://{LONE}"), "UrlImageSource.url"),
        (lambda: dr.Conversation(response_regex=LONE), "Conversation.response_regex"),
        (lambda: dr.SpecialTokens(eos=LONE), "SpecialTokens.eos"),
        (lambda: dr.ParsingOptions(stop_sequences=["ok", LONE]), r"ParsingOptions.stop_sequences\[1\]"),
        (
            lambda: dr.ConversionOptions().with_model_alias(LONE, dr.ModelVersion.DeepseekV4Pro),
            "a model name",
        ),
        (lambda: dr.InferenceChunk.text(LONE), "text chunk content"),
        (lambda: dr.InferenceChunk.ready(system_fingerprint=LONE), "system_fingerprint"),
        (lambda: dr.ChatCompletionResponse("r", LONE, 0), "ChatCompletionResponse model"),
    ]
    for make, where in cases:
        with pytest.raises(ValueError, match=f"{where}.* holds a lone surrogate U\\+D800") as info:
            make()
        assert not isinstance(info.value, UnicodeError), where
    with pytest.raises(ValueError, match="maximum nesting depth of 128"):
        dr.Conversation(response_schema=_nest(129))


def test_tokenizer_and_encoding_raise_runtime_error(v4_tokenizer):
    for fn in (v4_tokenizer.encode, v4_tokenizer.encode_plain, v4_tokenizer.count_tokens):
        with pytest.raises(RuntimeError, match="lone surrogate U\\+D800 at index 1"):
            fn(f"a{LONE}")
    with pytest.raises(
        RuntimeError, match="failed to encode conversation: the prompt holds a lone surrogate"
    ):
        v4_tokenizer.encode_prompt(f"a{LONE}", [])
    with pytest.raises(TypeError, match="must be a str"):
        v4_tokenizer.encode(5)
    with pytest.raises(RuntimeError, match="cannot read tokenizer file"):
        dr.Tokenizer.from_file(f"/nonexistent/{LONE}.json")


def test_stream_rechecks_mutable_inputs(v4_tokenizer):
    req = dr.ChatCompletionRequest(BODIES["chat_completions"]).convert()
    options = req.parsing_options
    options.stop_sequences = [LONE]  # assignable after construction: checked when a processor is built
    gen = dr.ChatCompletionRequest.chunk_generator(req, "r", "m")
    with pytest.raises(ValueError, match=r"stop_sequences\[0\] holds a lone surrogate"):
        dr.StreamProcessor(gen, options, v4_tokenizer)
    options.stop_sequences = ["END"]
    proc = dr.StreamProcessor(gen, options, v4_tokenizer)
    chunk = dr.InferenceChunk.text("ok")
    chunk.content = f"x{LONE}"
    with pytest.raises(RuntimeError, match="text chunk content holds a lone surrogate"):
        proc.push(chunk)
    with pytest.raises(RuntimeError, match="closed"):
        proc.finish()


def test_error_messages_of_deep_values_stay_short():
    deep = _nest(5000)
    with pytest.raises(ValueError) as info:
        dr.ConversionOptions(thinking_max_tokens_upper_bound=deep)
    assert len(str(info.value)) < 200
    with pytest.raises(TypeError) as info2:
        dr.InferenceChunk.finish(deep)
    assert len(str(info2.value)) < 200


def test_regex_nested_too_deep_is_not_a_regex():
    pattern = "(" * 1000 + ")" * 1000  # Python's regex parser recurses per group
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}},
        },
    }
    req = dr.ChatCompletionRequest({**BODIES["chat_completions"], "tools": [tool]})
    with pytest.raises(dr.ConversionError, match="Invalid schema for function 'f': .* is not a \"regex\""):
        req.convert()


def test_accumulators_and_echo_check_their_argument_types():
    req = dr.ChatCompletionRequest(BODIES["chat_completions"]).convert()
    chat_chunk = dr.StreamProcessor(
        dr.ChatCompletionRequest.chunk_generator(req, "r", "m"), req.parsing_options
    ).push(dr.InferenceChunk.ready())[0]
    for response in (dr.MessagesResponse("r", "m"), dr.ResponsesResponse("r", "m", 0)):
        with pytest.raises(TypeError, match="accumulate expects"):
            response.accumulate(chat_chunk)
    with pytest.raises(TypeError, match="accumulate expects a ChatCompletionChunk"):
        dr.ChatCompletionResponse("r", "m", 0).accumulate({"id": "x"})
    gen = dr.ResponsesChunkGenerator("r", "m", True)
    with pytest.raises(TypeError, match="echo must be a ResponsesEcho"):
        gen.with_echo({"instructions": "x"})
    with pytest.raises(ValueError, match="lone surrogate"):
        gen.with_namespace_tool_map({"f": ("ns", LONE)})


def test_non_finite_logprobs_serialize_as_null(v4_tokenizer):
    body = dict(BODIES["chat_completions"], logprobs=True, top_logprobs=1, thinking={"type": "disabled"})
    req = dr.ChatCompletionRequest(body).convert()
    proc = dr.StreamProcessor(
        dr.ChatCompletionRequest.chunk_generator(req, "r", "m"), req.parsing_options, v4_tokenizer
    )
    ids = v4_tokenizer.encode("hi")
    (_, content) = proc.push(dr.InferenceChunk.tokens(ids, [(float("nan"), [(5, float("-inf"))])]))
    text = content.to_json()
    entry = json.loads(text, parse_constant=pytest.fail)["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] is None and entry["top_logprobs"][0]["logprob"] is None


def test_out_of_range_numbers_in_chunks_are_value_or_runtime_errors(v4_tokenizer):
    for logprobs in ([(10**400, [])], [(0.0, [(float("inf"), 0.0)])]):
        with pytest.raises(ValueError, match="out of range"):
            dr.InferenceChunk.tokens([1], logprobs)
    req = dr.ChatCompletionRequest(BODIES["chat_completions"]).convert()
    proc = dr.StreamProcessor(
        dr.ChatCompletionRequest.chunk_generator(req, "r", "m"), req.parsing_options, v4_tokenizer
    )
    with pytest.raises(RuntimeError, match="invalid token id inf"):
        proc.push(dr.InferenceChunk.tokens([float("inf")]))
