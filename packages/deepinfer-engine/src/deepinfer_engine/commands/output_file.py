"""Output paths of the commands, checked before any model work: a typo in `-o` must fail in a second, not after
the whole batch has run (and lose its results)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from deepinfer_engine.errors import ConfigError

__all__ = ["check_output_path", "open_output"]


def check_output_path(name: str, *, option: str) -> Path:
    """`name` as a Path, or `ConfigError` naming `option` when it is a directory or its directory is missing."""
    path = Path(name)
    if path.is_dir():
        raise ConfigError(f"{option}: {name!r} is a directory; expected a file path")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"{option}: the directory {str(parent)!r} of {name!r} {what}; create it first")
    return path


def open_output(name: str, *, option: str) -> TextIO:
    """A text stream for `name` ('-' = stdout), opened now (UTF-8, truncated); errors name `option`."""
    if name == "-":
        return sys.stdout
    path = check_output_path(name, option=option)
    try:
        return path.open("w", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{option}: cannot write {name!r} ({exc.strerror or exc})") from None
