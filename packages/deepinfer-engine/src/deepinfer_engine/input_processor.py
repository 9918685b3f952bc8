"""Admission: one request's prompt and SamplingParams checked against this model, once, before anything is queued.

Everything that depends on the model is checked here and nowhere else: prompt ids are integers inside the
vocabulary, text is valid Unicode, logprobs / prompt_logprobs / stop_token_ids fit the vocabulary. A bad
request raises `InputError` naming the field, the value found and the expected range; nothing of it reaches the
engine core. (Capacity — a prompt longer than max_model_len or than the whole cache — is not an input error:
the scheduler finishes such a request at admission with finish_reason "error".)
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer_engine.errors import ConfigError, InputError
from deepinfer_engine.sampling_params import SamplingParams

__all__ = ["InputProcessor", "ProcessedRequest"]


@dataclass(frozen=True, kw_only=True)
class ProcessedRequest:
    """A validated request: the prompt text (if any), its token ids and its SamplingParams."""

    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        ch = text[exc.start]
        raise InputError(f"{where}: found a lone surrogate U+{ord(ch):04X} at character {exc.start}; expected "
                         f"valid Unicode text (decode bytes with errors='replace' first)") from None


class InputProcessor:
    """Turns a prompt (text, token ids, or {"prompt": ...} / {"prompt_token_ids": ..., "prompt": ...}) and a
    SamplingParams into a `ProcessedRequest`, or raises `InputError`.

    tokenizer: a `tokenizers.Tokenizer` or None (then only token-id prompts are accepted); bos_token_id is
    prepended to text prompts (the tokenizer adds nothing itself); vocab_size None disables the range checks
    (stand-in models in tests).
    """

    def __init__(self, *, tokenizer: Any, bos_token_id: int | None, vocab_size: int | None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.vocab_size = vocab_size
        if vocab_size is not None:
            bad = [t for t in eos_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ConfigError(f"eos_token_id: found {bad[0]}, expected an id in [0, {vocab_size}) "
                                  f"(the model's vocabulary); fix generation_config.json")

    def encode_prompt(self, text: str, *, where: str = "prompt") -> list[int]:
        """Plain text -> ids: tokenizer ids with BOS prepended."""
        if not isinstance(text, str):
            raise InputError(f"{where}: found {type(text).__name__}, expected a string")
        if self.tokenizer is None:
            raise InputError(f"{where}: got text but this engine has no tokenizer; pass token ids instead")
        _check_text(text, where)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def token_ids(self, ids: Any, *, where: str) -> tuple[int, ...]:
        """Validated prompt ids: integers (not bools, not floats) inside the vocabulary."""
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise InputError(f"{where}: found {type(ids).__name__}, expected a list of token ids")
        out = []
        vocab = self.vocab_size
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InputError(f"{where}[{j}]: found {t!r} ({type(t).__name__}), expected an integer token id")
            t = int(t)
            if t < 0 or (vocab is not None and t >= vocab):
                hi = f"{vocab}" if vocab is not None else "inf"
                raise InputError(f"{where}[{j}]: found token id {t}, expected an integer in [0, {hi})")
            out.append(t)
        return tuple(out)

    def check_params(self, params: Any, *, where: str) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise InputError(f"{where}: found {type(params).__name__}, expected SamplingParams")
        vocab = self.vocab_size
        if vocab is None:
            return params
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > vocab:
                raise InputError(f"{where}.{name}: found {v}, expected None or an integer in [0, {vocab}] "
                                 f"(the model's vocabulary size)")
        for t in params.stop_token_ids:
            if t >= vocab:
                raise InputError(f"{where}.stop_token_ids: found {t}, expected token ids in [0, {vocab})")
        return params

    def process(self, prompt: Any, params: Any, *, where: str = "prompt",
                params_where: str = "sampling_params") -> ProcessedRequest:
        """Validate one request (raises InputError); `where` / `params_where` prefix the messages
        (e.g. "prompts[3]")."""
        sp = self.check_params(params, where=params_where)
        if isinstance(prompt, str):
            return ProcessedRequest(prompt=prompt, prompt_token_ids=tuple(self.encode_prompt(prompt, where=where)),
                                    params=sp)
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise InputError(f"{where}['prompt']: found {type(text).__name__}, expected a string")
            if "prompt_token_ids" in prompt:
                if text is not None:
                    _check_text(text, f"{where}['prompt']")
                ids = self.token_ids(prompt["prompt_token_ids"], where=f"{where}['prompt_token_ids']")
                return ProcessedRequest(prompt=text, prompt_token_ids=ids, params=sp)
            if text is not None:
                return ProcessedRequest(prompt=text, prompt_token_ids=tuple(self.encode_prompt(text, where=where)),
                                        params=sp)
            raise InputError(f"{where}: dict without 'prompt' or 'prompt_token_ids' (keys {sorted(map(str, prompt))})")
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            return ProcessedRequest(prompt=None, prompt_token_ids=self.token_ids(prompt, where=where), params=sp)
        raise InputError(f"{where}: found {type(prompt).__name__}, expected str, list[int] or a prompt dict")
