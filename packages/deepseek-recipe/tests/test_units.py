"""Unit tests of the pieces the golden corpus exercises only indirectly."""

from __future__ import annotations

import deepseek_recipe as dr
import pytest
from deepseek_recipe import _json
from deepseek_recipe.parsing.decoder import StreamDecoder
from deepseek_recipe.responses._xxh3 import xxh3_64
from deepseek_recipe.responses.tool_call_id import new_tool_call_id, tool_call_id_checksum


def test_xxh3_known_vectors():
    # Published XXH3-64 digests (seed 0).
    assert xxh3_64(b"") == 0x2D06800538D394C2
    assert xxh3_64(b"a") == 0xE6C632B61E964E1F
    assert xxh3_64(b"abc") == 0x78AF5F94892F3950


def test_tool_call_id_shape_and_checksum():
    tid = new_tool_call_id(7, True)
    assert tid.startswith("call_07_ET_") and len(tid) == len("call_07_ET_") + 24
    assert int(tid[-4:]) == tool_call_id_checksum(tid[:-4])
    assert dr.requests._common.is_empty_thinking_tool_call_id(tid)
    assert not dr.requests._common.is_empty_thinking_tool_call_id(new_tool_call_id(7, False))


@pytest.mark.parametrize(
    ("value", "v4", "v41"),
    [
        (1e-05, "0.00001", "1e-05"),
        (2.5e-05, "0.000025", "2.5e-05"),
        (1e-06, "1e-6", "1e-06"),
        (1e-07, "1e-7", "1e-07"),
        (1e16, "1e+16", "1e+16"),
        (1e15, "1000000000000000.0", "1000000000000000.0"),
        (-0.0, "-0.0", "-0.0"),
        (0.0001, "0.0001", "0.0001"),
    ],
)
def test_float_styles(value, v4, v41):
    assert _json.dumps_spaced(value) == v4
    assert _json.dumps_python_style(value) == v41


def test_json_parse_semantics():
    assert _json.loads("18446744073709551616") == 1.8446744073709552e19
    assert _json.loads("18446744073709551615") == 2**64 - 1
    with pytest.raises(ValueError):
        _json.loads("NaN")
    assert (
        _json.dumps_spaced({"a": "\x1f\n", "b": [1, True, None]})
        == '{"a": "\\u001f\\n", "b": [1, true, null]}'
    )


def test_decoder_holds_back_partial_utf8(v4_tokenizer):
    ids = v4_tokenizer.encode("é😀")
    dec = StreamDecoder(v4_tokenizer)
    emitted = []
    for i in ids:  # one id at a time
        emitted.extend(p.content for p in dec.decode_incrementally([i]))
    assert "".join(emitted) == "é😀"
    assert all("\ufffd" not in e for e in emitted)


def test_special_tokens_in_user_text_stay_plain(v4_tokenizer):
    conv = dr.Conversation([dr.UserMessage("<think>")], thinking_mode=False)
    ids = dr.DeepseekV4Encoding().with_tokenizer(v4_tokenizer).encode(conv)
    assert 128821 not in ids  # <think> id
    assert v4_tokenizer.decode(ids) == "<｜begin▁of▁sentence｜><｜User｜><think><｜Assistant｜></think>"


def test_encode_without_tokenizer_raises():
    with pytest.raises(RuntimeError):
        dr.DeepseekV4Encoding().encode(dr.Conversation([dr.UserMessage("x")]))


def test_conversion_options_builders_are_copies():
    base = dr.ConversionOptions()
    other = base.with_model_alias("flash", dr.ModelVersion.DeepseekV41Flash).with_default_thinking_mode(False)
    assert (
        "flash" not in base.model_versions_by_name
        and other.model_versions_by_name["flash"] is dr.ModelVersion.DeepseekV41Flash
    )
    assert base.default_thinking_mode and not other.default_thinking_mode
    with pytest.raises(ValueError, match="thinking_max_tokens_upper_bound"):
        dr.ConversionOptions(thinking_max_tokens_upper_bound=-1)


def test_stream_processor_lifecycle(v4_tokenizer):
    req = dr.ChatCompletionRequest(
        {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "x"}], "stop": ["END"]}
    ).convert()
    gen = dr.ChatCompletionRequest.chunk_generator(req, "r", "m")
    proc = dr.StreamProcessor(gen, req.parsing_options, v4_tokenizer)
    proc.push(dr.InferenceChunk.text("r</think>ab", 3))
    assert not proc.finished
    proc.push(dr.InferenceChunk.text("cEND tail", 2))
    assert proc.finished  # the stop sequence ends processing
    with pytest.raises(RuntimeError, match="has finished"):
        proc.push(dr.InferenceChunk.text("more"))
    assert proc.finish() == []


def test_tokens_without_tokenizer_closes_processor():
    req = dr.ChatCompletionRequest(
        {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "x"}]}
    ).convert()
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(req, "r", "m"), req.parsing_options)
    with pytest.raises(RuntimeError, match="without a tokenizer"):
        proc.push(dr.InferenceChunk.tokens([1, 2]))
    with pytest.raises(RuntimeError):
        proc.finish()


def test_v41_system_token_is_flagged_unencodable_with_v4_tokenizer(v4_tokenizer):
    conv = dr.Conversation([dr.SystemMessage("s"), dr.UserMessage("u")])
    with pytest.raises(RuntimeError, match="<｜System｜>"):
        dr.DeepseekV41Encoding().with_tokenizer(v4_tokenizer).encode(conv)


def test_custom_special_tokens_render():
    tokens = dr.SpecialTokens(system="<|sys|>")
    rendered = (
        dr.DeepseekV41Encoding()
        .with_special_tokens(tokens)
        .render_conversation(
            dr.Conversation([dr.SystemMessage("s"), dr.UserMessage("u")], thinking_mode=False)
        )
    )
    assert rendered.prompt.startswith("<｜begin▁of▁sentence｜><|sys|>s")
    assert rendered.prompt[slice(*rendered.special_ranges[1])] == "<|sys|>"


def test_convert_consumes_the_request():
    req = dr.ChatCompletionRequest({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert req.model == "nope"
    with pytest.raises(dr.ConversionError):
        req.convert()
    with pytest.raises(RuntimeError, match="consumed"):
        _ = req.model
    with pytest.raises(RuntimeError, match="consumed"):
        req.convert()


def test_accumulate_consumes_the_chunk():
    req = dr.ChatCompletionRequest(
        {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "x"}]}
    ).convert()
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(req, "r", "m"), req.parsing_options)
    (first,) = proc.push(dr.InferenceChunk.ready())
    assert dr.ChatCompletionResponse.sse_event_name(first) is None
    dr.ChatCompletionResponse("r", "m", 0).accumulate(first)
    with pytest.raises(RuntimeError, match="consumed"):
        first.to_json()


def test_python_values_are_checked_as_json():
    cyclic: dict = {}
    cyclic["self"] = cyclic
    with pytest.raises(ValueError, match="circular reference"):
        dr.ToolDefinition("f", parameters=cyclic)
    deep: dict = {}
    node = deep
    for _ in range(128):
        node["n"] = {}
        node = node["n"]
    with pytest.raises(ValueError, match="maximum nesting depth of 128"):
        dr.ToolDefinition("f", parameters=deep)
    shared = {"type": "string"}
    params = {"type": "object", "properties": {"a": shared, "b": (shared,)}}
    assert dr.ToolDefinition("f", parameters=params).parameters == {
        "type": "object",
        "properties": {"a": shared, "b": [shared]},
    }
    with pytest.raises(ValueError, match="not a finite JSON number"):
        dr.ChatCompletionRequest({"model": "m", "messages": [], "temperature": float("nan")})
    with pytest.raises(ValueError, match="keys must be str"):
        dr.ToolDefinition("f", parameters={1: "x"})


def test_logprobs_flow_into_chat_chunks(v4_tokenizer):
    req = dr.ChatCompletionRequest(
        {
            "model": "DeepSeek-V4-Pro",
            "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "disabled"},
        }
    ).convert()
    proc = dr.StreamProcessor(
        dr.ChatCompletionRequest.chunk_generator(req, "r", "m"), req.parsing_options, v4_tokenizer
    )
    ids = v4_tokenizer.encode("Hi there")
    resp = dr.ChatCompletionResponse("r", "m", 0)
    chunks = (
        proc.push(dr.InferenceChunk.tokens(ids, [(-0.25, [(ids[0], -0.25)]) for _ in ids])) + proc.finish()
    )
    for c in chunks:
        resp.accumulate(c)
    entries = resp.to_dict()["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == "Hi there"
    assert entries[0]["bytes"] == list(entries[0]["token"].encode()) and entries[1]["logprob"] == -0.25
    with pytest.raises(RuntimeError, match="1 log probabilities for 2 token IDs"):
        dr.StreamProcessor(
            dr.ChatCompletionRequest.chunk_generator(req, "r", "m"), req.parsing_options, v4_tokenizer
        ).push(dr.InferenceChunk.tokens([5, 6], [(0.0, [])]))


@pytest.mark.parametrize(
    ("width", "height", "tokens", "best_w", "best_h"),
    # Reference V4.1 preprocessing results (official 0.2.0 token-spec test vectors).
    [
        (978, 479, 302, 980, 490),
        (2, 165, 356, 70, 4942),
        (10000, 158, 962, 10010, 168),
        (1920, 1080, 968, 1708, 966),
    ],
)
def test_v41_image_token_spec(width, height, tokens, best_w, best_h):
    from deepseek_recipe.images import ImageTokenSpec

    _, _, h, w, n = ImageTokenSpec().calc_resize(width, height)
    assert (n, w, h) == (tokens, best_w, best_h)
    data = dr.MultiModalData([dr.ImageInfo(b"", width, height), dr.ImageInfo(b"", 1, 1)])
    assert data.image_token_adjustment() == (tokens - 1) + (184 - 1)
