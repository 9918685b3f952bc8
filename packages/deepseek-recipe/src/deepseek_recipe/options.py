"""Option objects and enums: conversion options, inference options, parsing options."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field, replace
from typing import Any

from ._text import check_text, describe
from .encoding.special_tokens import DEFAULT_SPECIAL_TOKENS, SpecialTokens

__all__ = [
    "ModelVersion",
    "ReasoningContentBehavior",
    "WebSearchBehavior",
    "ConversionOptions",
    "InferenceOptions",
    "OutputConstraint",
    "ThinkingInitialStage",
    "ParsingOptions",
    "DEFAULT_MAX_TOKENS_UPPER_BOUND",
    "f32",
]

DEFAULT_MAX_TOKENS_UPPER_BOUND = 393_216


def f32(value: float) -> float:
    """Round to single precision, as the reference stores sampling parameters."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


class ModelVersion(enum.Enum):
    """The model version a converted conversation targets (selects the prompt encoding)."""

    DeepseekV4Pro = "deepseek_v4_pro"
    DeepseekV41Flash = "deepseek_v41_flash"

    def supports_image(self) -> bool:
        return self is ModelVersion.DeepseekV41Flash

    def supports_mid_conversation_system(self) -> bool:
        return self is ModelVersion.DeepseekV41Flash

    def resolve_top_p(self, top_p: float | None, thinking_mode: bool, has_tools: bool) -> float:
        if self is ModelVersion.DeepseekV41Flash:
            return max(f32(1.0 if top_p is None else top_p), f32(0.95)) if thinking_mode else 1.0
        if thinking_mode:
            return f32(0.95) if has_tools else 1.0
        return 1.0 if top_p is None else f32(top_p)

    def encoding(self):
        """A fresh prompt encoding for this version."""
        from .encoding.v4 import DeepseekV4Encoding
        from .encoding.v41 import DeepseekV41Encoding

        return DeepseekV41Encoding() if self is ModelVersion.DeepseekV41Flash else DeepseekV4Encoding()


class ReasoningContentBehavior(enum.Enum):
    """Handling of assistant history missing reasoning content in thinking mode."""

    FillEmpty = "fill_empty"
    Reject = "reject"


class WebSearchBehavior(enum.Enum):
    """Handling of supported web-search declarations, choices and Messages blocks."""

    Drop = "drop"
    Reject = "reject"


def _default_models() -> dict[str, ModelVersion]:
    return {
        "DeepSeek-V4-Pro": ModelVersion.DeepseekV4Pro,
        "DeepSeek-V4.1-Flash": ModelVersion.DeepseekV41Flash,
    }


@dataclass(frozen=True, kw_only=True)
class ConversionOptions:
    """Options for protocol request conversion (immutable; use the `with_*` builders)."""

    default_thinking_mode: bool = True
    reasoning_content_behavior: ReasoningContentBehavior = ReasoningContentBehavior.FillEmpty
    responses_web_search: WebSearchBehavior = WebSearchBehavior.Drop
    messages_web_search: WebSearchBehavior = WebSearchBehavior.Reject
    thinking_max_tokens_upper_bound: int = DEFAULT_MAX_TOKENS_UPPER_BOUND
    non_thinking_max_tokens_upper_bound: int = DEFAULT_MAX_TOKENS_UPPER_BOUND
    model_versions_by_name: dict[str, ModelVersion] = field(default_factory=_default_models)
    special_tokens: SpecialTokens = DEFAULT_SPECIAL_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.reasoning_content_behavior, ReasoningContentBehavior):
            raise TypeError(
                f"reasoning_content_behavior must be a ReasoningContentBehavior, got {describe(self.reasoning_content_behavior)}"
            )
        for name in ("responses_web_search", "messages_web_search"):
            if not isinstance(getattr(self, name), WebSearchBehavior):
                raise TypeError(f"{name} must be a WebSearchBehavior, got {describe(getattr(self, name))}")
        for name in ("thinking_max_tokens_upper_bound", "non_thinking_max_tokens_upper_bound"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < 2**32:
                raise ValueError(f"{name} must be an integer in [0, 2^32), got {describe(value)}")
        if not isinstance(self.special_tokens, SpecialTokens):
            raise TypeError(f"special_tokens must be SpecialTokens, got {describe(self.special_tokens)}")
        table = dict(self.model_versions_by_name)
        for name, version in table.items():
            if not isinstance(name, str) or not isinstance(version, ModelVersion):
                raise TypeError(
                    f"model_versions_by_name must map str to ModelVersion, got {describe(name)}: {describe(version)}"
                )
            check_text(name, "a model name of ConversionOptions.model_versions_by_name")
        object.__setattr__(self, "model_versions_by_name", table)

    def with_default_thinking_mode(self, default_thinking_mode: bool) -> ConversionOptions:
        return replace(self, default_thinking_mode=bool(default_thinking_mode))

    def with_reasoning_content_behavior(self, behavior: ReasoningContentBehavior) -> ConversionOptions:
        return replace(self, reasoning_content_behavior=behavior)

    def with_responses_web_search(self, behavior: WebSearchBehavior) -> ConversionOptions:
        return replace(self, responses_web_search=behavior)

    def with_messages_web_search(self, behavior: WebSearchBehavior) -> ConversionOptions:
        return replace(self, messages_web_search=behavior)

    def with_special_tokens(self, special_tokens: SpecialTokens) -> ConversionOptions:
        return replace(self, special_tokens=special_tokens)

    def with_model_alias(self, model: str, model_version: ModelVersion) -> ConversionOptions:
        if not isinstance(model, str) or not isinstance(model_version, ModelVersion):
            raise TypeError(
                f"with_model_alias expects (str, ModelVersion), got ({describe(model)}, {describe(model_version)})"
            )
        table = dict(self.model_versions_by_name)
        table[str(model)] = model_version
        return replace(self, model_versions_by_name=table)

    def with_model_versions_by_name(
        self, model_versions_by_name: dict[str, ModelVersion]
    ) -> ConversionOptions:
        return replace(self, model_versions_by_name=dict(model_versions_by_name))

    def with_thinking_max_tokens_upper_bound(self, bound: int) -> ConversionOptions:
        return replace(self, thinking_max_tokens_upper_bound=bound)

    def with_non_thinking_max_tokens_upper_bound(self, bound: int) -> ConversionOptions:
        return replace(self, non_thinking_max_tokens_upper_bound=bound)

    def resolve_model_version(self, model: str) -> ModelVersion:
        from .errors import ConversionError

        version = self.model_versions_by_name.get(model)
        if version is None:
            names = ", ".join(sorted(self.model_versions_by_name))
            raise ConversionError(f"The supported API model names are {names}, but you passed {model}.")
        return version

    def resolve_max_tokens_upper_bound(self, thinking_mode: bool) -> int:
        return (
            self.thinking_max_tokens_upper_bound
            if thinking_mode
            else self.non_thinking_max_tokens_upper_bound
        )


@dataclass(frozen=True, kw_only=True)
class OutputConstraint:
    """A constraint the backend may enforce: `kind` in json/regex/tool_call/tool_call_required."""

    kind: str
    schema: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "schema": self.schema}


@dataclass(frozen=True, kw_only=True)
class InferenceOptions:
    """Inference parameters extracted by conversion (temperature/top_p already resolved)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    seed: int | None = None
    output_constraint: OutputConstraint | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "seed": self.seed,
            "output_constraint": None if self.output_constraint is None else self.output_constraint.to_dict(),
        }


class ThinkingInitialStage(enum.Enum):
    """The stage where parsing begins in thinking mode."""

    ReasoningStart = "ReasoningStart"
    ReasoningContinuation = "ReasoningContinuation"
    ContentContinuation = "ContentContinuation"

    def starts_in_reasoning(self) -> bool:
        return self is not ThinkingInitialStage.ContentContinuation


@dataclass(kw_only=True)
class ParsingOptions:
    """Output-parser settings (what to recognise in generated text).

    Mutable on purpose: the official API exposes setters (e.g. `stop_sequences`), and a
    `StreamProcessor` snapshots the options when it is built.
    """

    parse_tool_calls: bool = True
    starts_in_tool_calls: bool = False
    parse_json_output: bool = False
    thinking_initial_stage: ThinkingInitialStage | None = None
    stop_sequences: list[str] = field(default_factory=list)
    special_tokens: SpecialTokens = DEFAULT_SPECIAL_TOKENS

    def __post_init__(self) -> None:
        if self.thinking_initial_stage is not None and not isinstance(
            self.thinking_initial_stage, ThinkingInitialStage
        ):
            raise TypeError(
                f"thinking_initial_stage must be a ThinkingInitialStage or None, got {describe(self.thinking_initial_stage)}"
            )
        if isinstance(self.stop_sequences, (str, bytes)):
            raise TypeError("stop_sequences must be a list of strings, got a single string")
        self.stop_sequences = [
            check_text(s, f"ParsingOptions.stop_sequences[{i}]") for i, s in enumerate(self.stop_sequences or ())
        ]
        if self.special_tokens is None:
            self.special_tokens = DEFAULT_SPECIAL_TOKENS
        if not isinstance(self.special_tokens, SpecialTokens):
            raise TypeError(f"special_tokens must be SpecialTokens or None, got {type(self.special_tokens).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "parse_tool_calls": self.parse_tool_calls,
            "starts_in_tool_calls": self.starts_in_tool_calls,
            "parse_json_output": self.parse_json_output,
            "thinking_initial_stage": None
            if self.thinking_initial_stage is None
            else self.thinking_initial_stage.value,
            "stop_sequences": list(self.stop_sequences),
        }
