"""Checks that user-supplied strings are valid Unicode (no lone surrogates).

A Python `str` may hold lone UTF-16 surrogates (U+D800..U+DFFF, e.g. from `"\\ud800"` or
`bytes.decode(errors="surrogateescape")`). They cannot be encoded as UTF-8, so they break the
tokenizer, the byte-level output parser and every JSON consumer downstream; the reference (Rust
strings) cannot represent them at all. Every entry point rejects them where the string enters, with
that entry point's documented error type.
"""

from __future__ import annotations

import reprlib

__all__ = ["surrogate_index", "surrogate_message", "check_text", "check_opt_text", "describe"]


def surrogate_index(text: str) -> int | None:
    """Index of the first lone surrogate in `text`, or None when `text` encodes as UTF-8."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def surrogate_message(where: str, text: str, index: int) -> str:
    return (
        f"{where} holds a lone surrogate U+{ord(text[index]):04X} at index {index}, which is not valid "
        "Unicode; remove it, or decode the source bytes with errors='replace'"
    )


def check_text(value: object, where: str, error: type[Exception] = ValueError) -> str:
    """`value` as a str that encodes as UTF-8: TypeError when it is no str, `error` for a lone surrogate."""
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a str, got {type(value).__name__}")
    text = str(value)
    index = surrogate_index(text)
    if index is not None:
        raise error(surrogate_message(where, text, index))
    return text


def check_opt_text(value: object, where: str, error: type[Exception] = ValueError) -> str | None:
    """Like `check_text`, but None passes through."""
    return None if value is None else check_text(value, where, error)


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 80
_REPR.maxother = 80


def describe(value: object) -> str:
    """A short, always-printable repr of a user value for error messages.

    Bounded in depth and length, so a value nested thousands of levels deep (or a huge string)
    cannot turn the error message itself into a RecursionError or a megabyte of text.
    """
    try:
        return _REPR.repr(value)
    except Exception:  # a user type whose __repr__ fails
        return f"<{type(value).__name__} object>"
