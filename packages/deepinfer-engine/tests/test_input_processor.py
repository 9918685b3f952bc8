"""InputProcessor: the one admission check of a request against the model (vocabulary, ids, text, params)."""

from __future__ import annotations

import pytest
from deepinfer_engine.errors import ConfigError, InputError
from deepinfer_engine.input_processor import InputProcessor
from deepinfer_engine.sampling_params import SamplingParams


class _Enc:
    def __init__(self, ids):
        self.ids = ids


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return _Enc([ord(c) % 50 + 2 for c in text])


def _ip(**kw) -> InputProcessor:
    return InputProcessor(**{"tokenizer": _Tok(), "bos_token_id": 0, "vocab_size": 60, **kw})


SP = SamplingParams()


def test_accepted_prompt_forms() -> None:
    ip = _ip()
    assert ip.process("ab", SP).prompt_token_ids == (0, ord("a") % 50 + 2, ord("b") % 50 + 2)
    assert ip.process([0, 5], SP).prompt_token_ids == (0, 5)
    assert ip.process((0, 5), SP).prompt_token_ids == (0, 5)
    r = ip.process({"prompt_token_ids": [3], "prompt": "x"}, SP)
    assert (r.prompt, r.prompt_token_ids) == ("x", (3,))
    assert ip.process({"prompt": "a"}, SP).prompt == "a"
    np = pytest.importorskip("numpy")
    assert ip.process([np.int64(4)], SP).prompt_token_ids == (4,)


@pytest.mark.parametrize("prompt,msg", [
    ([0, 60], r"prompt\[1\]: found token id 60, expected an integer in \[0, 60\)"),
    ([0, -1], "found token id -1"),
    ([0, 5.7], r"prompt\[1\]: found 5.7 \(float\), expected an integer token id"),
    ([False], r"found False \(bool\)"),
    ({"prompt_token_ids": "abc"}, r"prompt\['prompt_token_ids'\]: found str"),
    ({"prompt": b"x"}, r"prompt\['prompt'\]: found bytes"),
    ({"prompt_token_ids": [1], "prompt": "\udfff"}, "lone surrogate U\\+DFFF"),
    ({}, "dict without 'prompt' or 'prompt_token_ids'"),
    (3.5, "found float"),
    ("x\ud800", r"prompt: found a lone surrogate U\+D800 at character 1"),
])
def test_bad_prompts_are_typed(prompt, msg) -> None:
    with pytest.raises(InputError, match=msg):
        _ip().process(prompt, SP)


def test_model_dependent_params() -> None:
    ip = _ip()
    ip.process([1], SamplingParams(logprobs=60, prompt_logprobs=60, stop_token_ids=[59]))
    for kw, msg in [(dict(logprobs=61), r"sampling_params.logprobs: found 61, expected None or an integer in \[0, 60\]"),
                    (dict(prompt_logprobs=61), "prompt_logprobs: found 61"),
                    (dict(stop_token_ids=[60]), r"stop_token_ids: found 60, expected token ids in \[0, 60\)")]:
        with pytest.raises(InputError, match=msg):
            ip.process([1], SamplingParams(**kw))
    with pytest.raises(InputError, match="found dict, expected SamplingParams"):
        ip.process([1], {"temperature": 0})
    with pytest.raises(InputError, match="no tokenizer"):
        _ip(tokenizer=None).process("text", SP)
    with pytest.raises(ConfigError, match="eos_token_id: found 70"):
        _ip(eos_token_ids=(1, 70))
