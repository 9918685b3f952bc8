"""Replay of render.jsonl: conversion, prompt text, special ranges, token ids, resolved max_tokens."""

from __future__ import annotations

import deepseek_recipe as R
import pytest
from recipe_testing import build_conversation, convert_request, golden_params


@pytest.mark.parametrize("case", golden_params("render.jsonl"))
def test_render_case(case, v4_tokenizer):
    e = case["expected"]
    if case["api"] == "conversation":
        conv = build_conversation(case["conversation_spec"])
        version = R.ModelVersion(case["model_version_requested"])
        request = None
    else:
        request = convert_request(case["api"], case["request"], case.get("options") or {})
        conv = request.conversation
        version = request.model_version
        assert request.stream == e["stream"]
        assert request.inference_options.to_dict() == e["inference_options"]
        assert request.parsing_options.to_dict() == e["parsing_options"]
    assert version.value == e["model_version"]
    assert conv.to_dict() == e["conversation"]
    encoding = version.encoding()
    rendered = encoding.render_conversation(conv)
    assert rendered.prompt == e["prompt"]
    assert [list(r) for r in rendered.special_ranges] == e["special_ranges"]
    assert [rendered.prompt[a:b] for a, b in rendered.special_ranges] == e["special_tokens"]
    assert [s.to_dict() for s in rendered.image_sources] == e["image_sources"]
    try:
        ids = encoding.with_tokenizer(v4_tokenizer).encode(conv)
        error = None
    except RuntimeError as exc:
        ids, error = None, str(exc)
    assert error == e["encode_error"]
    assert ids == e["token_ids"]
    if ids is not None:
        assert (v4_tokenizer.encode(rendered.prompt) == ids) == e["full_vocab_encode_equal"]
    if request is not None and e["resolved_max_tokens"] is not None:
        rm = e["resolved_max_tokens"]
        assert rm["prompt_tokens"] == len(ids)
        if "error" in rm and rm.get("error") is not None:
            with pytest.raises(R.ConversionError) as info:
                request.resolve_max_tokens(len(ids), rm["context_limit"])
            assert str(info.value) == rm["error"]
        else:
            assert request.resolve_max_tokens(len(ids), rm["context_limit"]) == rm["result"]
