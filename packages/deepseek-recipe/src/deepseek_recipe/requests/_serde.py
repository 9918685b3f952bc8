"""A small typed reader for request bodies that reports errors in serde's wording.

The reference deserializes request JSON with serde; its error texts (`missing
field `model``, `unknown variant `x`, expected one of ...`, `invalid type:
string "hi", expected a sequence`) are part of the observable behaviour.
"""

from __future__ import annotations

from typing import Any

from .. import _json
from ..options import f32

__all__ = ["SchemaError", "parse_body", "Reader"]


class SchemaError(ValueError):
    """The body does not match the protocol schema (message in serde's wording)."""


def _rust_debug_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{{{ord(ch):x}}}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def unexpected(value: Any) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return f"boolean `{'true' if value else 'false'}`"
    if type(value) is int:
        return f"integer `{value}`"
    if type(value) is float:
        text = repr(value)
        if text.endswith(".0"):
            text = text[:-2]
        return f"floating point `{text}`"
    if type(value) is str:
        return f"string {_rust_debug_str(value)}"
    if type(value) is list:
        return "sequence"
    return "map"


def invalid_type(value: Any, expected: str) -> SchemaError:
    return SchemaError(f"invalid type: {unexpected(value)}, expected {expected}")


def parse_body(body: Any) -> Any:
    """Body (dict, str or bytes) → JSON value.

    Raises ValueError: `invalid JSON request: ...` for text that is not JSON (or nests 128
    arrays/objects deep, or holds a lone surrogate), `invalid request body: ...` for a dict
    holding something that is not JSON; TypeError for a body of another type.
    """
    if isinstance(body, dict):
        # Python → JSON conversion as the reference binding does it (non-finite floats, cycles,
        # nesting beyond 128 levels, lone surrogates and non-JSON types are all rejected).
        try:
            return _json.from_python(body)
        except _json.JSONError as exc:
            raise ValueError(f"invalid request body: {exc}") from None
    if isinstance(body, (bytes, bytearray, memoryview)):
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"invalid JSON request: invalid unicode code point at byte {exc.start}"
            ) from None
    elif isinstance(body, str):
        text = str(body)
    else:
        raise TypeError(f"request body must be bytes, str or dict, got {type(body).__name__}")
    try:
        return _json.loads(text)
    except _json.JSONError as exc:
        message = _serde_json_error(text) if exc.kind == "syntax" else str(exc)
        raise ValueError(f"invalid JSON request: {message}") from None


def _serde_json_error(text: str) -> str:
    """Approximate serde_json's syntax-error message (category + line/column)."""
    import json

    try:
        json.loads(text)
        return "number out of range"
    except json.JSONDecodeError as e:
        exc = e
    except ValueError:
        return "number out of range"
    pos = exc.pos
    ws = " \t\n\r"
    i = pos
    if exc.msg.startswith("Expecting value"):
        while i < len(text) and text[i] in ws:
            i += 1
        if i >= len(text):
            line, col = _line_col(text, len(text))
            return f"EOF while parsing a value at line {line} column {col}"
        ch = text[i]
        for word in ("true", "false", "null"):
            if ch == word[0]:
                j = 0
                while i + j < len(text) and j < len(word) and text[i + j] == word[j]:
                    j += 1
                line, col = _line_col(text, i + j + 1)
                return f"expected ident at line {line} column {col}"
        line, col = _line_col(text, i + 1)
        return f"expected value at line {line} column {col}"
    if exc.msg.startswith("Extra data"):
        line, col = _line_col(text, pos + 1)
        return f"trailing characters at line {line} column {col}"
    line, col = _line_col(text, pos + 1)
    return f"{exc.msg[0].lower()}{exc.msg[1:]} at line {line} column {col}"


def _line_col(text: str, pos: int) -> tuple[int, int]:
    before = text[:pos]
    line = before.count("\n") + 1
    col = pos - (before.rfind("\n") + 1)
    return line, col


class Reader:
    """Typed field access over a JSON object, with serde-style errors."""

    __slots__ = ("obj",)

    def __init__(self, value: Any, expected: str) -> None:
        if type(value) is not dict:
            raise invalid_type(value, expected)
        self.obj = value

    def has(self, name: str) -> bool:
        return self.obj.get(name) is not None

    def raw(self, name: str) -> Any:
        return self.obj.get(name)

    def opt_variant(self, name: str, variants: tuple[str, ...]) -> str | None:
        """An optional unit enum variant (None when absent or null)."""
        value = self.obj.get(name)
        return None if value is None else variant(value, variants)

    def required(self, name: str) -> Any:
        if name not in self.obj:
            raise SchemaError(f"missing field `{name}`")
        return self.obj[name]

    # typed scalars -------------------------------------------------------------------------
    @staticmethod
    def as_str(value: Any) -> str:
        if type(value) is not str:
            raise invalid_type(value, "a string")
        return value

    @staticmethod
    def as_bool(value: Any) -> bool:
        if type(value) is not bool:
            raise invalid_type(value, "a boolean")
        return value

    @staticmethod
    def as_uint(value: Any, bits: int) -> int:
        name = f"u{bits}"
        if type(value) is not int:
            raise invalid_type(value, name)
        if value < 0 or value >= 2**bits:
            raise SchemaError(f"invalid value: integer `{value}`, expected {name}")
        return value

    @staticmethod
    def as_f32(value: Any) -> float:
        if type(value) not in (int, float):
            raise invalid_type(value, "f32")
        return f32(float(value))

    @staticmethod
    def as_list(value: Any) -> list:
        if type(value) is not list:
            raise invalid_type(value, "a sequence")
        return value

    def _as(self, value: Any, kind: str, bits: int) -> Any:
        """`value` checked as `kind` ("str", "bool", "uint" of `bits` bits, "f32", "list"); other kinds: as is."""
        if kind == "str":
            return self.as_str(value)
        if kind == "bool":
            return self.as_bool(value)
        if kind == "uint":
            return self.as_uint(value, bits)
        if kind == "f32":
            return self.as_f32(value)
        if kind == "list":
            return self.as_list(value)
        return value

    def opt(self, name: str, kind: str, bits: int = 0) -> Any:
        value = self.obj.get(name)
        return None if value is None else self._as(value, kind, bits)

    def req(self, name: str, kind: str, bits: int = 0) -> Any:
        return self._as(self.required(name), kind, bits)


def variant(value: Any, variants: tuple[str, ...]) -> str:
    """A unit enum variant given as a string."""
    if type(value) is not str:
        raise invalid_type(value, "a string" if False else "variant identifier")
    if value not in variants:
        expected = ", ".join(f"`{v}`" for v in variants)
        if len(variants) == 1:
            raise SchemaError(f"unknown variant `{value}`, expected {expected}")
        raise SchemaError(f"unknown variant `{value}`, expected one of {expected}")
    return value


def tagged(value: Any, tag: str, variants: tuple[str, ...], expected: str) -> str:
    """The tag of an internally tagged enum object."""
    if type(value) is not dict:
        raise invalid_type(value, expected)
    if tag not in value:
        raise SchemaError(f"missing field `{tag}`")
    return variant(value[tag], variants)
