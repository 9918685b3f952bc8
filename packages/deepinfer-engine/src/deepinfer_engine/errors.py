"""Typed, user-facing errors of the engine. Each message says what was found, what was expected and what to change."""

from __future__ import annotations


class DeepInferError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelConfigError(DeepInferError, ValueError):
    """A checkpoint's config.json is missing a field or holds an inconsistent value."""


class CheckpointError(DeepInferError, RuntimeError):
    """A checkpoint file is missing, truncated, or holds a tensor of the wrong name, shape or dtype."""


class ConfigError(DeepInferError, ValueError):
    """An engine option is unknown or out of range."""


class CapacityError(DeepInferError, RuntimeError):
    """The requested work cannot fit into the configured memory or length limits."""


class InputError(DeepInferError, ValueError):
    """A request's input (token ids, positions, prompt length) is invalid for this model."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exception types that report bad input or a bad environment, never a bug of the code: the CLI prints them
    as one `error:` line (exit 2) and `run-batch` as the failed line's error, instead of a traceback.

    This package's errors, the recipe's documented request errors (`ConversionError`, `ImageError`,
    `CalcResizeError`), a kernel backend that cannot run the inputs, and OS errors on user-named files."""
    from deepinfer_kernels import KernelBackendError
    from deepseek_recipe import CalcResizeError, ConversionError, ImageError

    return (DeepInferError, ConversionError, ImageError, CalcResizeError, KernelBackendError, OSError)
