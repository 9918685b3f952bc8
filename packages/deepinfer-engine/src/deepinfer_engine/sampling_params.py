"""`SamplingParams`: per-request generation options (vLLM names and defaults). Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from deepinfer_engine.errors import InputError


class SamplingParamsError(InputError):
    """A SamplingParams field is out of range; the message names the field, the value and the allowed range."""


def _f(default, help: str, cli=None):
    return field(default=default, metadata={"help": help, "cli": cli})


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to generate for one prompt.

    temperature 0 = greedy. top_k 0 or -1 = off; top_p 1 = off; min_p 0 = off. repetition_penalty 1 = off
    (applies to prompt and output tokens); presence/frequency penalties 0 = off (output tokens only).
    seed: per-request reproducible sampling, independent of the rest of the batch (None: the engine derives one
    from its own `seed` option and the request's position); any int: seeds in [0, 2**63) key the sampler as they
    are, others (negative, >= 2**63) are hashed over all their bits, so distinct seeds never collide by truncation. stop: strings that end the output (not included
    unless include_stop_str_in_output); stop_token_ids: ids that end it (included in token_ids, not in text).
    max_tokens None = until max_model_len. logprobs / prompt_logprobs: number of top alternatives to return
    per position (0 = only the chosen token), None = off. n: independent samples per prompt.
    """

    # metadata "help" documents the field; "cli" (argparse type, or "flag" / "append") makes it a command-line flag
    n: int = _f(1, "samples per prompt", int)
    max_tokens: int | None = _f(16, "tokens to generate per prompt", int)
    min_tokens: int = _f(0, "tokens before EOS / stop ids may end the output", int)
    temperature: float = _f(1.0, "sampling temperature; 0 = greedy", float)
    top_p: float = _f(1.0, "nucleus mass (1 = off)", float)
    top_k: int = _f(0, "keep the k most likely tokens (0 = off)", int)
    min_p: float = _f(0.0, "drop tokens below min_p x the top probability (0 = off)", float)
    repetition_penalty: float = _f(1.0, "tokens seen in prompt or output: logit / p if > 0 else logit x p (1 = off)", float)
    presence_penalty: float = _f(0.0, "subtract this from logits of tokens already generated (0 = off)", float)
    frequency_penalty: float = _f(0.0, "subtract this x count of each generated token (0 = off)", float)
    seed: int | None = _f(None, "per-request seed (on the command line --seed is the engine seed instead)")
    stop: str | tuple[str, ...] | list[str] | None = _f(None, "stop string (repeatable)", "append")
    stop_token_ids: tuple[int, ...] | list[int] | None = _f(None, "stop token id (repeatable)", "append_int")
    ignore_eos: bool = _f(False, "keep generating after EOS", "flag")
    include_stop_str_in_output: bool = _f(False, "keep the matched stop string in the text", "flag")
    logprobs: int | None = _f(None, "top alternatives' logprobs per generated token", int)
    prompt_logprobs: int | None = _f(None, "top alternatives' logprobs per prompt token")
    skip_special_tokens: bool = _f(True, "leave special tokens out of the text", "flag")

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> SamplingParamsError:
            return SamplingParamsError(f"SamplingParams.{name}: found {getattr(self, name)!r}, expected {expected}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer >= 1, or 0 / -1 for off")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                raise bad(name, "a number in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "an integer or None")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list | tuple):
            stop = tuple(stop)
        else:
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        for s in stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise bad("stop", "valid Unicode strings (found a lone surrogate)") from None
        object.__setattr__(self, "stop", stop)
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, list | tuple):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        ids = tuple(self.stop_token_ids or ())
        if any(not is_int(t) or t < 0 for t in ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", ids)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                raise bad(name, "None or an integer >= 0 (number of top alternatives)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def replace(self, **changes) -> SamplingParams:
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def add_sampling_args(parser, *, defaults: dict | None = None) -> None:
    """One flag per SamplingParams field with "cli" metadata (`--max-tokens`, `--stop S` repeatable, ...), help
    text and default from the dataclass (`defaults` overrides a command's defaults).

    There is no per-request `--seed` here: on the command line `--seed` is the engine seed, from which every
    request's seed is derived (so runs are reproducible, as with a per-request seed)."""
    import argparse

    defaults = defaults or {}
    group = parser.add_argument_group("sampling")
    for f in fields(SamplingParams):
        cli = f.metadata.get("cli")
        if cli is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        d = defaults.get(f.name, f.default)
        text = f"{f.metadata['help']} (default: {'none' if d is None else d})"
        if cli == "flag":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=d, help=text)
        elif cli in ("append", "append_int"):
            group.add_argument(flag, dest=f.name, action="append", type=int if cli == "append_int" else str,
                               default=None, help=f"{f.metadata['help']} (default: none)")
        else:
            group.add_argument(flag, dest=f.name, type=cli, default=d, help=text)


def sampling_flag_names() -> list[str]:
    return [f.name for f in fields(SamplingParams) if f.metadata.get("cli") is not None]


def sampling_params_from_cli(ns, **overrides) -> SamplingParams:
    kw = {name: getattr(ns, name) for name in sampling_flag_names() if hasattr(ns, name)}
    kw.update(overrides)
    return SamplingParams(**kw)
