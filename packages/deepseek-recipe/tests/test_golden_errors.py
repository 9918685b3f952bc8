"""Replay of errors.jsonl: every invalid input raises the reference's error type, message and body."""

from __future__ import annotations

import json

import deepseek_recipe as R
import pytest
from recipe_testing import (
    build_conversation,
    conversion_options,
    drive_stream,
    golden_params,
    request_class,
)


def _check_error(exc: BaseException | None, expected: dict | None) -> None:
    if expected is None:
        assert exc is None, f"unexpected {type(exc).__name__}: {exc}"
        return
    assert exc is not None, f"expected {expected['type']}: {expected['message']}"
    assert type(exc).__name__ == expected["type"]
    assert str(exc) == expected["message"]
    if expected["type"] == "ConversionError":
        assert exc.status_code == expected["status_code"]
        assert json.loads(exc.body) == expected["body"]


def _body(request):
    return request if isinstance(request, str) else json.dumps(request, ensure_ascii=False)


@pytest.mark.parametrize("case", golden_params("errors.jsonl"))
def test_error_case(case, v4_tokenizer):
    stage = case["stage"]
    expected = case["expected"]
    options = conversion_options(case.get("options") or {})
    exc: BaseException | None = None
    if stage == "conversation":
        extra = case["extra"]
        try:
            if "conversation_spec" in extra:
                build_conversation(extra["conversation_spec"])
            else:
                R.Conversation([R.UserMessage("x")], **extra["conversation_kwargs"])
        except (ValueError, TypeError) as e:
            exc = e
        _check_error(exc, expected["error"])
        return
    cls = request_class(case["api"])
    if stage == "request_parse":
        with pytest.raises(ValueError) as info:
            cls(_body(case["request"]))
        _check_error(info.value, expected["error"])
        return
    request = cls(_body(case["request"]))
    model = request.model  # convert() consumes the request
    if stage in ("convert", "accepted"):
        try:
            request.convert(options)
        except R.ConversionError as e:
            exc = e
        _check_error(exc, expected["error"])
        return
    converted = request.convert(options)
    if stage == "resolve_max_tokens":
        extra = case["extra"]
        result = None
        try:
            result = converted.resolve_max_tokens(extra["prompt_tokens"], extra["context_limit"])
        except R.ConversionError as e:
            exc = e
        _check_error(exc, expected["error"])
        assert result == expected["result"]
        return
    assert stage == "stream"
    extra = case["extra"]
    out = drive_stream(
        case["api"],
        converted,
        extra["chunks"],
        tokenizer=v4_tokenizer if extra["with_tokenizer"] else None,
        call_finish=True,
        model=model,
    )
    _check_error(out["error_exc"], expected["error"])
    assert out["stream"] == expected["stream"]
