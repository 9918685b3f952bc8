"""Typed errors of deepinfer-dspark (the engine maps them onto its own ConfigError)."""

from __future__ import annotations

__all__ = ["DSparkConfigError", "DSparkInputError"]


class DSparkConfigError(ValueError):
    """A DSparkConfig field is invalid; the message names the field, the value found and what is expected."""


class DSparkInputError(ValueError):
    """A tensor passed to verification / statistics has the wrong shape, dtype or value range (named in the message)."""
