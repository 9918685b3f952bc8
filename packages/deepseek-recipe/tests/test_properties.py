"""Hypothesis property tests: round trips, chunking invariance, garbage robustness."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from recipe_testing import normalize

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Text that likes to collide with markup: special-token spellings, DSML pieces, newlines, non-ASCII.
_PIECES = [
    "hello",
    " world",
    "\n",
    "\n\n",
    "<think>",
    "</think>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "｜DSML｜",
    "<｜DSML｜",
    "</｜DSML｜",
    "<｜end▁of▁sentence｜>",
    "<｜ref｜>",
    "<｜/ref｜>",
    '"',
    "{",
    "[",
    "```json\n",
    "END",
    "é",
    "😀",
    "中文",
    "  ",
    "\t",
]
text = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=6)), max_size=8).map("".join)


@st.composite
def conversations(draw):
    msgs = []
    for _ in range(draw(st.integers(1, 6))):
        role = draw(st.sampled_from(["system", "user", "assistant", "tool", "latest_reminder"]))
        if role == "system":
            msgs.append(dr.SystemMessage(draw(text)))
        elif role == "user":
            msgs.append(dr.UserMessage(draw(text)))
        elif role == "assistant":
            calls = None
            if draw(st.booleans()):
                calls = [
                    dr.ToolCall(
                        draw(st.text("abc123", min_size=1, max_size=4)),
                        "f",
                        draw(st.sampled_from(['{"a": 1}', '{"q": "x"}', "not json", draw(text)])),
                    )
                    for _ in range(draw(st.integers(0, 2)))
                ]
            msgs.append(dr.AssistantMessage(draw(text), draw(st.one_of(st.none(), text)), calls))
        elif role == "tool":
            msgs.append(dr.ToolMessage(draw(text), draw(st.one_of(st.none(), st.text("abc", max_size=2)))))
        else:
            msgs.append(dr.LatestReminderMessage(draw(text)))
    if draw(st.booleans()) and isinstance(msgs[-1], dr.AssistantMessage):
        last = msgs[-1]
        msgs[-1] = dr.AssistantMessage(last.content, last.reasoning_content, None, prefix=True)
    tools = [
        dr.ToolDefinition(
            "f",
            draw(st.one_of(st.none(), text)),
            {"type": "object", "properties": {"a": {"type": "number", "default": 1e-6}}},
        )
    ]
    return dr.Conversation(
        msgs,
        thinking_mode=draw(st.booleans()),
        tools=tools if draw(st.booleans()) else [],
        tool_choice=draw(st.sampled_from(["auto", "none", "required"])),
        reasoning_effort=draw(st.sampled_from([None, "low", "high", "xhigh", "max"])),
        response_format=draw(st.sampled_from(["text", "json_object"])),
    )


@pytest.fixture(scope="module")
def v41_test_tokenizer():
    # [I] A V4-derived tokenizer that also knows `<｜System｜>` (at 128799, as third-party V4.1 configs list it),
    # so V4.1 prompts can be round-tripped; not the real V4.1 tokenizer.
    from deepseek_recipe.tokenizer import default_tokenizer_path

    data = json.loads(open(default_tokenizer_path(), encoding="utf-8").read())
    for tok in data["added_tokens"]:
        if tok["id"] == 128799:
            tok["content"] = "<｜System｜>"
    for key, value in list(data["model"]["vocab"].items()):
        if value == 128799:
            del data["model"]["vocab"][key]
            data["model"]["vocab"]["<｜System｜>"] = 128799
    return dr.Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


@SETTINGS
@given(conv=conversations(), v41=st.booleans())
def test_render_encode_decode_round_trip(conv, v41, v4_tokenizer, v41_test_tokenizer):
    enc = dr.DeepseekV41Encoding() if v41 else dr.DeepseekV4Encoding()
    tok = v41_test_tokenizer if v41 else v4_tokenizer
    rendered = enc.render_conversation(conv)
    ids = enc.with_tokenizer(tok).encode(conv)
    assert tok.decode(ids) == rendered.prompt
    # Each explicit special range is exactly one added-vocabulary id, and nothing else is.
    specials = [rendered.prompt[a:b] for a, b in rendered.special_ranges]
    assert [i for i in ids if tok.is_special_token(i)] == [tok.token_id(s) for s in specials]


_OUTPUT_PIECES = [
    "I think",
    " so.",
    "\n",
    "</think>",
    "Answer: 42",
    "END",
    "é😀中",
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">x "y"\n</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="b" string="false">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
    '<｜DSML｜ invoke name="g">\n</｜DSML｜ invoke>',
    "<｜DSM",
    "</｜DSML｜",
    "<think>",
]
outputs = st.lists(st.sampled_from(_OUTPUT_PIECES), min_size=1, max_size=8).map("".join)


def _request(thinking: bool, tools: bool, stop: bool):
    body = {
        "model": "DeepSeek-V4-Pro",
        "messages": [{"role": "user", "content": "q"}],
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if tools:
        body["tools"] = [
            {"type": "function", "function": {"name": "f"}},
            {"type": "function", "function": {"name": "g"}},
        ]
    if stop:
        body["stop"] = ["END"]
    return dr.ChatCompletionRequest(body).convert()


def _run(req, chunks, tok):
    gen = dr.ChatCompletionRequest.chunk_generator(req, "r", "m")
    proc = dr.StreamProcessor(gen, req.parsing_options, tok)
    resp = dr.ChatCompletionResponse("r", "m", 0, 0, 0)
    for c in chunks:
        if proc.finished:
            break
        for out in proc.push(c):
            resp.accumulate(out)
    for out in proc.finish():
        resp.accumulate(out)
    data = normalize(json.loads(resp.to_json()))
    if req.parsing_options.stop_sequences:
        # Where a stop sequence ends the stream, the completion-token count depends on how the ids
        # were grouped into decoded pieces (the whole piece holding the stop is counted), as in the reference.
        data.pop("usage", None)
    return data


def _splits(draw, n):
    cuts = sorted(set(draw(st.lists(st.integers(0, n), max_size=6))))
    bounds = [0, *cuts, n]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i] < bounds[i + 1]]


@SETTINGS
@given(data=st.data(), output=outputs, thinking=st.booleans(), tools=st.booleans(), stop=st.booleans())
def test_stream_result_independent_of_chunking(data, output, thinking, tools, stop, v4_tokenizer):
    req = _request(thinking, tools, stop)
    # Text mode: split at arbitrary code-point positions.
    whole = _run(
        req,
        [dr.InferenceChunk.text(output), dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)],
        v4_tokenizer,
    )
    parts = [dr.InferenceChunk.text(output[a:b]) for a, b in _splits(data.draw, len(output))]
    split = _run(req, [*parts, dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)], v4_tokenizer)
    assert split == whole
    # Token mode: split the id sequence anywhere (also inside multi-byte characters).
    ids = v4_tokenizer.encode(output)
    whole_t = _run(req, [dr.InferenceChunk.tokens(ids)], v4_tokenizer)
    parts_t = [dr.InferenceChunk.tokens(ids[a:b]) for a, b in _splits(data.draw, len(ids))]
    assert _run(req, parts_t, v4_tokenizer) == whole_t


@SETTINGS
@given(
    body=st.one_of(
        st.binary(max_size=64),
        text,
        st.dictionaries(
            st.sampled_from(["model", "messages", "tools", "stop", "n", "thinking"]),
            st.one_of(st.none(), st.integers(), text, st.lists(st.integers(), max_size=2)),
            max_size=4,
        ),
    )
)
def test_garbage_requests_raise_only_documented_errors(body):
    for cls in (dr.ChatCompletionRequest, dr.MessagesRequest, dr.ResponsesRequest):
        try:
            cls(body).convert()
        except (ValueError, dr.ConversionError) as exc:
            assert not isinstance(exc, UnicodeError)  # documented: malformed body / invalid request


@SETTINGS
@given(
    chunks=st.lists(
        st.one_of(
            st.lists(st.integers(-5, 140_000), max_size=12).map(dr.InferenceChunk.tokens),
            text.map(dr.InferenceChunk.text),
        ),
        max_size=6,
    ),
    thinking=st.booleans(),
    tools=st.booleans(),
)
def test_garbage_stream_raises_only_runtime_error(chunks, thinking, tools, v4_tokenizer):
    req = _request(thinking, tools, True)
    proc = dr.StreamProcessor(
        dr.ChatCompletionRequest.chunk_generator(req, "r", "m"), req.parsing_options, v4_tokenizer
    )
    try:
        for c in chunks:
            if proc.finished:
                break
            for out in proc.push(c):
                json.loads(out.to_json())
        proc.finish()
    except RuntimeError:
        assume(True)
