"""`deepinfer chat` streaming through deepseek-recipe's StreamProcessor, on the tiny V4.1 checkpoint.

Scripted replies: the runner's sampled ids are replaced by a fixed script (reasoning, `</think>`, content, a stray
placeholder token, EOS), so the expected printed text comes from the script, not from the code under test.
"""

from __future__ import annotations

import argparse
import io
import json

import pytest
from deepinfer_engine.cli import main
from deepinfer_engine.commands import chat as chat_cmd
from deepinfer_engine.llm import LLM
from engine_testing import plain_ids, script_replies

FAST = ["--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def llm(tiny_v41_dir) -> LLM:
    return LLM(str(tiny_v41_dir), device="cpu", dtype="float32")


def _added(llm: LLM) -> dict[int, str]:
    return {i: t.content for i, t in llm.tokenizer.get_added_tokens_decoder().items()}


def _id(llm: LLM, spelling: str) -> int:
    tid = llm.tokenizer.token_to_id(spelling)
    assert tid is not None, spelling
    return tid


def _ns(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chat_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


def _assert_no_special_spelling(llm: LLM, text: str) -> None:
    shown = [s for s in _added(llm).values() if s in text]
    assert not shown, f"raw special-token spellings in the output: {shown[:5]}"


def test_chat_streams_reasoning_content_and_keeps_history(llm, monkeypatch) -> None:
    eos = llm.engine.eos_token_ids[0]
    think_end = _id(llm, "</think>")
    stray = _id(llm, "<｜place▁holder▁no▁7｜>")
    reply1 = plain_ids(llm, "Let me think.") + [think_end] + plain_ids(llm, "Hello there!") + [stray] + [eos]
    reply2 = plain_ids(llm, "Fine.") + [eos]
    prompts = script_replies(llm, monkeypatch, [reply1, reply2])
    out = io.StringIO()
    rc = chat_cmd.chat_loop(llm, _ns("--thinking", "--max-tokens", "40", "--temperature", "0"),
                            stdin=io.StringIO("Hi there\nHow are you?\n"), stdout=out)
    text = out.getvalue()
    assert rc == 0
    assert "[thinking] Let me think.[/thinking]\nHello there!" in text
    assert "[finish: stop; 1 special token(s) not shown]" in text
    assert text.count("assistant> ") == 2 and "assistant> [thinking] Fine." in text
    _assert_no_special_spelling(llm, text)
    # the second prompt re-renders the first turn: user line, assistant content, then the new user line
    assert len(prompts) == 2
    second = llm.tokenizer.decode(prompts[1], skip_special_tokens=False)
    assert second.index("Hi there") < second.index("Hello there!") < second.index("How are you?")


def test_chat_tool_call_is_reported_when_complete(llm, monkeypatch) -> None:
    eos = llm.engine.eos_token_ids[0]
    markup = ('Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
              '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
              '</｜DSML｜ calls>')
    script_replies(llm, monkeypatch, [plain_ids(llm, markup) + [eos]])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    printed: list = []
    out = llm.chat([{"role": "user", "content": "Weather in Paris?"}], None, tools=tools, use_tqdm=False,
                   on_delta=lambda c, s, d: printed.append(d))
    co = out[0].outputs[0]
    assert co.parse_error is None and co.content.strip() == "Checking."
    calls = [d.tool_call for d in printed if d.kind == "tool_call"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert co.tool_calls and co.tool_calls[0]["function"]["name"] == "get_weather"
    assert [d.kind for d in printed][-2:] == ["tool_call", "finish"] and printed[-1].finish_reason == "tool_calls"


def test_recipe_stop_sequence_stops_generation(llm, monkeypatch) -> None:
    eos = llm.engine.eos_token_ids[0]
    reply = plain_ids(llm, "one two STOP three four five six seven eight nine") + [eos]
    script_replies(llm, monkeypatch, [reply])
    r = llm.render_chat_body({"model": "m", "messages": [{"role": "user", "content": "count"}], "stop": ["STOP"],
                              "thinking": {"type": "disabled"}})
    from deepinfer_engine.sampling_params import SamplingParams

    out = llm.generate_chat([r], [SamplingParams(max_tokens=40, temperature=0)], use_tqdm=False)[0].outputs[0]
    assert out.content.rstrip() == "one two" and out.finish_reason == "stop"
    assert len(out.token_ids) < len(reply) - 3  # generation ended at the stop sequence, not at EOS


def test_parse_failure_shows_raw_text_and_names_the_problem(llm, monkeypatch) -> None:
    import deepseek_recipe as dr

    def broken(self, chunk):
        raise RuntimeError("synthetic decoder failure")

    monkeypatch.setattr(dr.StreamProcessor, "push", broken)
    eos = llm.engine.eos_token_ids[0]
    script_replies(llm, monkeypatch, [plain_ids(llm, "alpha</think>beta") + [eos]])
    out = io.StringIO()
    chat_cmd.chat_loop(llm, _ns("--max-tokens", "20", "--temperature", "0"), stdin=io.StringIO("Hi\n"), stdout=out)
    text = out.getvalue()
    assert "[warning: deepseek-recipe could not parse the completion: RuntimeError: synthetic decoder failure" in text
    assert "alpha</think>beta" in text  # the raw text, not a guessed reasoning/content split


def test_deepinfer_chat_cli_real_model_hides_special_tokens(tiny_v41_dir, monkeypatch, capsys) -> None:
    # real (random) generation: with seed 0 the second reply contains a placeholder special token [I: depends on
    # the tiny weights]; whatever is generated, no added-vocabulary spelling may be printed
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\nAgain\n"))
    rc = main(["chat", "--model", str(tiny_v41_dir), "--max-tokens", "6", "--temperature", "0", *FAST])
    text = capsys.readouterr().out
    assert rc == 0 and text.count("assistant> ") == 2 and text.count("[finish: length") == 2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_v41_dir / "tokenizer.json"))
    shown = [t.content for t in tok.get_added_tokens_decoder().values() if t.content in text]
    assert not shown, shown


def test_generate_help_documents_every_flag(capsys) -> None:
    import dataclasses

    from deepinfer_engine.cli import _subparser, build_parser
    from deepinfer_engine.config import engine_option_names
    from deepinfer_engine.sampling_params import SamplingParams

    sub = _subparser(build_parser(), "generate")
    flags = {o for a in sub._actions for o in a.option_strings}
    for name in engine_option_names():  # engine flags come from the config dataclasses
        assert "--" + name.replace("_", "-") in flags, name
    cli_fields = [f.name for f in dataclasses.fields(SamplingParams) if f.metadata.get("cli") is not None]
    assert {"max_tokens", "temperature", "stop", "stop_token_ids", "logprobs"} <= set(cli_fields)
    for name in cli_fields:
        assert "--" + name.replace("_", "-") in flags, name
    for action in sub._actions:
        assert action.help and action.help.strip(), f"{action.option_strings or action.dest} has no help"
        if action.option_strings and action.option_strings[0] != "-h":
            assert "default" in action.help, f"{action.option_strings[0]}: help does not state the default"
            assert action.help.count("(default:") <= 1, f"{action.option_strings[0]}: two defaults: {action.help!r}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "--kv-cache-memory-bytes" in text and "--stop-token-ids" in text and "(default: None)" not in text


def test_generate_progress_bar_shows_live_rates(llm, capsys) -> None:
    import re

    from deepinfer_engine.sampling_params import SamplingParams

    llm.bar_refresh_s = 0.0  # redraw after every step
    try:
        llm.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=True)
    finally:
        del llm.bar_refresh_s
    frames = re.split(r"[\r\n]", capsys.readouterr().err)
    running = [f for f in frames if "0/1" in f]
    # while the only prompt is still running, the bar already shows non-zero prefill and decode rates
    assert any(re.search(r"prefill [1-9]\d* tok/s", f) for f in running), running
    assert any(re.search(r"decode [1-9]\d* tok/s", f) for f in running), running


def test_run_batch_chat_stop_applies_to_content_not_reasoning(llm, monkeypatch) -> None:
    from deepinfer_engine.commands.run_batch import process

    eos = llm.engine.eos_token_ids[0]
    reply = (plain_ids(llm, "think STOP more") + [_id(llm, "</think>")] + plain_ids(llm, "answer STOP tail words here")
             + [eos])
    script_replies(llm, monkeypatch, [reply])
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "go"}], "stop": ["STOP"],
                     "max_tokens": 40, "temperature": 0, "thinking": {"type": "enabled"}}}
    (res,) = process(llm, [json.dumps(line)], default_max_tokens=40, use_tqdm=False)
    assert res["error"] is None, res["error"]
    msg = res["response"]["body"]["choices"][0]["message"]
    assert msg["reasoning_content"] == "think STOP more"
    assert msg["content"].strip() == "answer"
    assert res["response"]["body"]["usage"]["completion_tokens"] < len(reply) - 2  # stopped at the content STOP


def test_stop_sequence_stops_only_its_own_sample(llm, monkeypatch) -> None:
    from deepinfer_engine.sampling_params import SamplingParams

    eos = llm.engine.eos_token_ids[0]
    a = plain_ids(llm, "alpha STOP beta gamma delta epsilon") + [eos]
    b = plain_ids(llm, "one two three") + [eos]
    script_replies(llm, monkeypatch, [a, b])
    r = llm.render_chat_body({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["STOP"],
                              "thinking": {"type": "disabled"}})
    out = llm.generate_chat([r], [SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=1)], use_tqdm=False)[0]
    s0, s1 = out.outputs
    assert s0.content.strip() == "alpha" and s0.finish_reason == "stop" and len(s0.token_ids) < len(a) - 2
    assert s1.content == "one two three" and s1.finish_reason == "stop" and len(s1.token_ids) == len(b)
