"""JSON helpers that reproduce the reference's serde_json behaviour in Python.

* Parsing (`loads`): RFC 8259 only (no NaN/Infinity), integers outside the
  i64/u64 range become floats (serde_json without arbitrary precision), keys
  keep insertion order, duplicate keys keep the last value.
* Serialization: "spaced" (`", "`, `": "`) and compact flavours; non-ASCII is
  written raw; floats as Python `repr` except the V4 spaced style, which writes
  values in [1e-5, 1e-4) in plain decimal and smaller exponents unpadded
  (docs/recipe.md §3).
"""

from __future__ import annotations

import json
import math
from typing import Any

from ._text import describe, surrogate_index, surrogate_message

__all__ = ["loads", "dumps_spaced", "dumps_python_style", "dumps_compact", "JSONError"]

_I64_MIN = -(2**63)
_U64_MAX = 2**64 - 1


class JSONError(ValueError):
    """Invalid JSON text or value.

    `kind`: "syntax" (not JSON), "number" (a non-finite number), "depth" (nested too deep),
    "surrogate" (a string holding a lone surrogate) or "value" (a Python value that is not JSON).
    """

    def __init__(self, message: str, kind: str = "syntax") -> None:
        super().__init__(message)
        self.kind = kind


def _reject_constant(name: str) -> Any:
    raise JSONError(f"invalid JSON number {name}")


def _parse_int(text: str) -> int | float:
    value = int(text)
    if _I64_MIN <= value <= _U64_MAX:
        return value
    return float(text)


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_int=_parse_int)

# serde_json's recursion budget: the 128th nested array/object of a JSON text is rejected.
_SERDE_DEPTH = 128


def loads(text: str) -> Any:
    """Parse JSON text as serde_json does; raises `JSONError` (a ValueError).

    Beyond json's syntax errors, rejects (like serde_json) numbers that overflow to infinity,
    nesting of 128 arrays/objects or more, and strings holding lone surrogates (`"\\ud800"`).
    """
    try:
        value = _DECODER.decode(text)
    except JSONError:
        raise
    except json.JSONDecodeError as exc:
        # serde_json reads left to right: nesting too deep before the syntax error is reported instead.
        deep = _depth_message(text, exc.pos)
        raise (JSONError(deep, "depth") if deep else JSONError(str(exc))) from None
    except RecursionError:
        raise JSONError(_depth_message(text), "depth") from None
    _check(value, text)
    return value


def _check(value: Any, text: str) -> None:
    # Python parses 1e999 to inf, nests without limit and keeps lone surrogates; serde_json rejects all three.
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if t is str:
            if surrogate_index(v) is not None:
                raise JSONError(_locate_surrogate(value), "surrogate")
        elif t is float:
            if not math.isfinite(v):
                raise JSONError("number out of range", "number")
        elif t is dict or t is list:
            if depth >= _SERDE_DEPTH:
                raise JSONError(_depth_message(text), "depth")
            if t is dict:
                for k, x in v.items():
                    if surrogate_index(k) is not None:
                        raise JSONError(_locate_surrogate(value), "surrogate")
                    stack.append((x, depth + 1))
            else:
                stack.extend((x, depth + 1) for x in v)


def _depth_message(text: str, end: int | None = None) -> str | None:
    """serde_json's error for the first array/object opened at nesting level 128 (line, byte column).

    With `end`, only `text[:end]` is scanned and None means no such array/object there.
    """
    depth = 0
    in_string = escaped = False
    for i, ch in enumerate(text if end is None else text[:end]):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth >= _SERDE_DEPTH:
                start = text.rfind("\n", 0, i) + 1
                line = text.count("\n", 0, i) + 1
                column = len(text[start : i + 1].encode("utf-8", "surrogatepass"))
                return (
                    f"recursion limit exceeded at line {line} column {column} (arrays/objects may nest at "
                    f"most {_SERDE_DEPTH - 1} levels deep; flatten the value)"
                )
        elif ch in "]}":
            depth -= 1
    if end is not None:
        return None
    return f"recursion limit exceeded (arrays/objects may nest at most {_SERDE_DEPTH - 1} levels deep)"


def _locate_surrogate(value: Any) -> str:
    """Message naming the path of the first string (or key) of `value` that holds a lone surrogate."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if type(v) is str:
            index = surrogate_index(v)
            if index is not None:
                return surrogate_message(f"the string at {path or '<root>'}", v, index)
        elif type(v) is dict:
            items = list(v.items())
            for k, _ in items:
                index = surrogate_index(k)
                if index is not None:
                    return surrogate_message(f"the key {describe(k)} at {path or '<root>'}", k, index)
            stack.extend((x, _join(path, k)) for k, x in reversed(items))
        elif type(v) is list:
            stack.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
    return "a string holds a lone surrogate, which is not valid Unicode"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


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
    finite, strings must encode as UTF-8); lists and tuples become lists; dicts need
    str keys. Everything else raises `JSONError` (a ValueError) naming the path of the
    offending item: a container that contains itself, nesting deeper than 128
    containers, or a value of another type.
    """
    try:
        return _from_python(value, [], [])
    except RecursionError:  # only when the caller's own stack is already nearly exhausted
        raise JSONError(
            f"the value nests too deeply (at most {MAX_JSON_DEPTH} arrays/objects)", "depth"
        ) from None


def _path(keys: list) -> str:
    out = ""
    if len(keys) > 8:  # a depth error's path: the head is enough to find the value
        return _path(keys[:6]) + f"...({len(keys)} levels)"
    for k in keys:
        out += f"[{k}]" if type(k) is int else (f".{k}" if out else k)
    return out or "<root>"


def _from_python(value: Any, parents: list[int], keys: list) -> Any:
    if value is None or isinstance(value, bool):
        return bool(value) if value is not None else None
    if isinstance(value, str):
        text = str(value)
        index = surrogate_index(text)
        if index is not None:
            raise JSONError(surrogate_message(f"the string at {_path(keys)}", text, index), "surrogate")
        return text
    if isinstance(value, int):
        if not _I64_MIN <= value <= _U64_MAX:
            raise JSONError(
                f"{_path(keys)}: integer {value} is outside the JSON number range [-2^63, 2^64)", "number"
            )
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise JSONError(f"{_path(keys)}: {_rust_float(value)} is not a finite JSON number", "number")
        return float(value)
    if not isinstance(value, (list, tuple, dict)):
        raise JSONError(
            f"{_path(keys)}: {type(value).__name__} is not a JSON value (use str, int, float, bool, None, "
            "list or dict)",
            "value",
        )
    ident = id(value)
    if ident in parents:
        raise JSONError(f"{_path(keys)}: circular reference in JSON input", "value")
    if len(parents) >= MAX_JSON_DEPTH:
        raise JSONError(
            f"{_path(keys)}: JSON input exceeds the maximum nesting depth of {MAX_JSON_DEPTH} arrays/objects; "
            "flatten the value",
            "depth",
        )
    parents.append(ident)
    try:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise JSONError(
                        f"{_path(keys)}: JSON object keys must be str, got {type(k).__name__}", "value"
                    )
                key = str(k)
                index = surrogate_index(key)
                if index is not None:
                    raise JSONError(
                        surrogate_message(f"a key of the object at {_path(keys)}", key, index), "surrogate"
                    )
                keys.append(key)
                out[key] = _from_python(v, parents, keys)
                keys.pop()
            return out
        out_list = []
        for i, v in enumerate(value):
            keys.append(i)
            out_list.append(_from_python(v, parents, keys))
            keys.pop()
        return out_list
    finally:
        parents.pop()


def _rust_float(value: float) -> str:
    if value != value:
        return "NaN"
    return "inf" if value > 0 else "-inf"
