"""JSON helpers that reproduce the reference's serde_json behaviour in Python.

* Parsing (`loads`): RFC 8259 only (no NaN/Infinity), integers outside the
  i64/u64 range become floats (serde_json without arbitrary precision), keys
  keep insertion order, duplicate keys keep the last value.
* Serialization: "spaced" (`", "`, `": "`) and compact flavours; non-ASCII is
  written raw; floats as Python `repr` except the V4 spaced style, which writes
  values in [1e-5, 1e-4) in plain decimal and smaller exponents unpadded
  (recipe.md §3).
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["loads", "dumps_spaced", "dumps_python_style", "dumps_compact", "JSONError"]

_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1


class JSONError(ValueError):
    """Invalid JSON text."""


def _reject_constant(name: str) -> Any:
    raise JSONError(f"invalid JSON number {name}")


def _parse_int(text: str) -> int | float:
    value = int(text)
    if _I64_MIN <= value <= _U64_MAX:
        return value
    return float(text)


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_int=_parse_int)


def loads(text: str) -> Any:
    """Parse JSON text; raises `JSONError` (a ValueError) with json's message."""
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise JSONError(str(exc)) from None
    except RecursionError:
        raise JSONError("recursion limit exceeded") from None
    _check(value)
    return value


_SERDE_DEPTH = 128  # serde_json's recursion limit for nested arrays/objects


def _check(value: Any) -> None:
    # Numbers like 1e999 parse to inf in Python and nesting is unlimited; serde_json rejects both.
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if t is float:
            if not math.isfinite(v):
                raise JSONError("number out of range")
        elif t is dict or t is list:
            if depth >= _SERDE_DEPTH:
                raise JSONError("recursion limit exceeded")
            stack.extend((x, depth + 1) for x in (v.values() if t is dict else v))


def _float_python(value: float) -> str:
    return repr(value)


def _float_v4(value: float) -> str:
    text = repr(value)
    if "e-0" in text:
        mantissa, exp = text.split("e-0")
        if exp == "5":
            # [1e-5, 1e-4): serde's default formatter writes plain decimal.
            sign = ""
            if mantissa.startswith("-"):
                sign, mantissa = "-", mantissa[1:]
            digits = mantissa.replace(".", "")
            return f"{sign}0.0000{digits}"
        return f"{mantissa}e-{exp}"
    return text


def _str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _dumps(value: Any, float_fmt, item_sep: str, key_sep: str) -> str:
    out: list[str] = []
    append = out.append

    def emit(v: Any) -> None:
        t = type(v)
        if t is str:
            append(_str(v))
        elif v is None:
            append("null")
        elif v is True:
            append("true")
        elif v is False:
            append("false")
        elif t is int:
            append(str(v))
        elif t is float:
            if not math.isfinite(v):
                append("null")  # serde_json writes non-finite floats as null
            else:
                append(float_fmt(v))
        elif t is dict:
            append("{")
            first = True
            for k, item in v.items():
                if not first:
                    append(item_sep)
                first = False
                append(_str(k if isinstance(k, str) else str(k)))
                append(key_sep)
                emit(item)
            append("}")
        elif t is list or t is tuple:
            append("[")
            first = True
            for item in v:
                if not first:
                    append(item_sep)
                first = False
                emit(item)
            append("]")
        elif isinstance(v, bool):
            append("true" if v else "false")
        elif isinstance(v, int):
            append(str(int(v)))
        elif isinstance(v, float):
            append(float_fmt(float(v)))
        elif isinstance(v, str):
            append(_str(str(v)))
        elif isinstance(v, dict):
            emit(dict(v))
        elif isinstance(v, (list, tuple)):
            emit(list(v))
        else:
            raise TypeError(f"value of type {type(v).__name__} is not JSON serializable")

    emit(value)
    return "".join(out)


def dumps_spaced(value: Any) -> str:
    """V4 "spaced" JSON (serde_json default float formatting)."""
    return _dumps(value, _float_v4, ", ", ": ")


def dumps_python_style(value: Any) -> str:
    """V4.1 "python style" JSON: like `json.dumps(value, ensure_ascii=False)`."""
    return _dumps(value, _float_python, ", ", ": ")


def dumps_compact(value: Any) -> str:
    """Compact JSON as serde_json writes it (`,` and `:`)."""
    return _dumps(value, _float_v4, ",", ":")


MAX_JSON_DEPTH = 128


def from_python(value: Any) -> Any:
    """Validate and copy a Python value as JSON (the reference's Python → JSON conversion).

    None/bool/str/int/float pass through (ints must fit i64 or u64, floats must be
    finite); lists and tuples become lists; dicts need str keys. A container that
    contains itself raises ValueError; nesting deeper than 128 containers raises
    RecursionError; any other type raises TypeError.
    """
    return _from_python(value, [])


def _from_python(value: Any, parents: list[int]) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        if not _I64_MIN <= value <= _U64_MAX:
            raise OverflowError("integer is outside the JSON number range")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{_rust_float(value)} is not a finite JSON number")
        return float(value)
    if not isinstance(value, (list, tuple, dict)):
        raise TypeError(f"{type(value).__name__} is not a JSON value")
    ident = id(value)
    if ident in parents:
        raise ValueError("circular reference in JSON input")
    if len(parents) >= MAX_JSON_DEPTH:
        raise RecursionError(f"JSON input exceeds the maximum nesting depth of {MAX_JSON_DEPTH}")
    parents.append(ident)
    try:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError("JSON object keys must be str")
                out[str(k)] = _from_python(v, parents)
            return out
        return [_from_python(v, parents) for v in value]
    finally:
        parents.pop()


def _rust_float(value: float) -> str:
    if value != value:
        return "NaN"
    return "inf" if value > 0 else "-inf"
