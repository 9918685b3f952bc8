"""Cross-package: LLM.generate on a tiny random V4.1 checkpoint, and the chat round trip through
deepseek-recipe (render with the V4.1 encoding -> generate -> parse reasoning / content / tool calls)."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest
from deepinfer_engine import LLM, CompletionOutput, SamplingParams
from deepinfer_engine.chat_stream import ChatStream
from deepinfer_engine.model.writer import make_checkpoint

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    d = make_checkpoint(tmp_path_factory.mktemp("tiny_v41") / "ckpt", "v41", "tiny", 0)
    return LLM(str(d), device="cpu", dtype="float32", page_size=4)


def test_generate_mixed_inputs_in_order(llm: LLM) -> None:
    outs = llm.generate(["Hello there", [0, 5, 6], {"prompt_token_ids": [0, 9]}],
                        SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.prompt_token_ids[1:] for o in outs][1:] == [[5, 6], [9]]
    assert outs[0].prompt_token_ids[0] == 0  # BOS prepended to text prompts
    assert all(len(o.outputs[0].token_ids) == 3 and o.finished for o in outs)
    tok = dr.Tokenizer.from_file(str(llm.engine.model_dir / "tokenizer.json"))
    assert outs[0].prompt_token_ids[1:] == tok.encode("Hello there")


def test_chat_prompt_is_the_recipe_rendering(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    req = dr.ChatCompletionRequest({"model": "DeepSeek-V4.1-Flash", "messages": messages,
                                    "thinking": {"type": "disabled"}}).convert()
    tok = dr.Tokenizer.from_file(str(llm.engine.model_dir / "tokenizer.json"))
    assert isinstance(req.encoding(), dr.DeepseekV41Encoding)
    assert out.prompt_token_ids == req.encoding().with_tokenizer(tok).encode(req.conversation)
    co = out.outputs[0]
    assert len(co.token_ids) >= 1 and co.content is not None and co.reasoning_content is None


def _parse(llm: LLM, messages, model_text: str, *, thinking: bool, tools=None) -> CompletionOutput:
    rendered = llm.render_chat(messages, thinking=thinking, tools=tools)
    tok = llm._recipe_tokenizer()
    co = CompletionOutput(index=0, token_ids=tok.encode(model_text) + [1], finish_reason="stop")
    co.text = model_text
    # the same incremental path LLM.chat uses: push the ids in two pieces, EOS last, then finish
    stream = ChatStream(rendered.request, tok, eos_token_ids=llm.engine.eos_token_ids)
    half = len(co.token_ids) // 2
    stream.push(co.token_ids[:half])
    stream.push(co.token_ids[half:], final=True)
    stream.finish(co.finish_reason)
    stream.apply_to(co)
    assert co.parse_error is None, co.parse_error
    return co


def test_chat_output_parsing_reasoning_content_and_tool_calls(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    co = _parse(llm, msgs, "Let me think.</think>Hello!", thinking=True)
    assert (co.reasoning_content, co.content) == ("Let me think.", "Hello!")
    call = ('Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
            '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
            '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    co = _parse(llm, [{"role": "user", "content": "Weather in Paris?"}], call, thinking=False, tools=[WEATHER_TOOL])
    assert co.content == "Checking."
    assert co.tool_calls is not None and len(co.tool_calls) == 1
    fn = co.tool_calls[0]["function"]
    assert fn["name"] == "get_weather" and json.loads(fn["arguments"]) == {"city": "Paris"}
