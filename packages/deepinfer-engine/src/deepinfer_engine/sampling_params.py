"""`SamplingParams`: per-request generation options (vLLM names and defaults). Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from deepinfer_engine.errors import InputError


class SamplingParamsError(InputError):
    """A SamplingParams field is out of range; the message names the field, the value and the allowed range."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to generate for one prompt.

    temperature 0 = greedy. top_k 0 or -1 = off; top_p 1 = off; min_p 0 = off. repetition_penalty 1 = off
    (applies to prompt and output tokens); presence/frequency penalties 0 = off (output tokens only).
    seed: per-request reproducible sampling, independent of the rest of the batch (None: the engine derives one
    from its own `seed` option and the request's position). stop: strings that end the output (not included
    unless include_stop_str_in_output); stop_token_ids: ids that end it (included in token_ids, not in text).
    max_tokens None = until max_model_len. logprobs / prompt_logprobs: number of top alternatives to return
    per position (0 = only the chosen token), None = off. n: independent samples per prompt.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | tuple[str, ...] | list[str] | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

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
        else:
            stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", stop)
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


_CLI_FIELDS = {
    "max_tokens": (int, "tokens to generate per prompt"),
    "min_tokens": (int, "tokens before EOS / stop ids may end the output"),
    "temperature": (float, "0 = greedy"),
    "top_p": (float, "nucleus mass (1 = off)"),
    "top_k": (int, "keep the k most likely tokens (0 = off)"),
    "min_p": (float, "drop tokens below min_p x the top probability (0 = off)"),
    "repetition_penalty": (float, "1 = off"),
    "presence_penalty": (float, "0 = off"),
    "frequency_penalty": (float, "0 = off"),
    "n": (int, "samples per prompt"),
    "logprobs": (int, "top alternatives' logprobs per generated token"),
}


def add_sampling_args(parser, *, defaults: dict | None = None) -> None:
    """`--max-tokens`, `--temperature`, ... `--stop S` (repeatable), `--ignore-eos` from the SamplingParams fields.

    There is no per-request `--seed` here: on the command line `--seed` is the engine seed, from which every
    request's seed is derived (so runs are reproducible, as with a per-request seed)."""
    import argparse

    defaults = defaults or {}
    base = {f.name: f.default for f in fields(SamplingParams)}
    group = parser.add_argument_group("sampling")
    for name, (typ, text) in _CLI_FIELDS.items():
        d = defaults.get(name, base[name])
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=d,
                           help=f"{text} (default: {d})")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=defaults.get("ignore_eos", False),
                       help="keep generating after EOS")


def sampling_params_from_cli(ns, **overrides) -> SamplingParams:
    kw = {name: getattr(ns, name) for name in _CLI_FIELDS if hasattr(ns, name)}
    kw["stop"] = getattr(ns, "stop", None)
    kw["ignore_eos"] = bool(getattr(ns, "ignore_eos", False))
    kw.update(overrides)
    return SamplingParams(**kw)
