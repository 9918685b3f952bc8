"""Replay of parse.jsonl: stream chunks, accumulated response, finish state and errors."""

from __future__ import annotations

import pytest
from recipe_testing import convert_request, drive_stream, golden_params


def _summary(response: dict) -> dict:
    choice = response["choices"][0]
    msg = choice["message"]
    return {
        "reasoning_content": msg.get("reasoning_content"),
        "content": msg.get("content"),
        "tool_calls": [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in msg.get("tool_calls") or []
        ],
        "finish_reason": choice["finish_reason"],
        "usage": response.get("usage"),
    }


@pytest.mark.parametrize("case", golden_params("parse.jsonl"))
def test_parse_case(case, v4_tokenizer):
    e = case["expected"]
    converted = convert_request(case["api"], case["request"], case.get("options") or {})
    assert converted.parsing_options.to_dict() == e["parsing_options"]
    out = drive_stream(
        case["api"],
        converted,
        case["chunks"],
        tokenizer=v4_tokenizer,
        call_finish=case["call_finish"],
        model=case["request"]["model"],
        response_id=case["response_id"],
        created=case["created"],
    )
    err = out["error_exc"]
    assert (None if err is None else {"type": type(err).__name__, "message": str(err)}) == e["error"]
    assert out["chunks_pushed"] == e["chunks_pushed"]
    assert out["finished"] == e["finished"]
    assert out["sse_done_data"] == e["sse_done_data"]
    assert out["stream"] == e["stream"]
    assert out["response"] == e["response"]
    if e.get("summary") is not None:
        assert _summary(out["response"]) == e["summary"]
