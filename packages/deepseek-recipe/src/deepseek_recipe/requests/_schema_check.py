"""JSON Schema checks used by conversion: meta-schema validation and strict normalization."""

from __future__ import annotations

import re
from typing import Any

from .. import _json
from ..errors import ConversionError

__all__ = ["validate_schema", "normalize_strict_schema", "default_strict_schema"]

_SIMPLE_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ARRAYS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_SINGLE = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
)
_NON_NEGATIVE = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)


def _j(value: Any) -> str:
    return _json.dumps_compact(value)


def validate_schema(schema: Any) -> str | None:
    """Validate `schema` against (a subset of) the JSON Schema meta-schema; return the first error."""
    # Wording follows the `jsonschema` crate used by the reference.
    return _check(schema)


def _check(s: Any) -> str | None:
    if type(s) is bool:
        return None
    if type(s) is not dict:
        return f'{_j(s)} is not of types "boolean", "object"'
    if "type" in s:
        t = s["type"]
        ok = (type(t) is str and t in _SIMPLE_TYPES) or (
            type(t) is list
            and t
            and all(type(x) is str and x in _SIMPLE_TYPES for x in t)
            and len(set(t)) == len(t)
        )
        if not ok:
            return f"{_j(t)} is not valid under any of the schemas listed in the 'anyOf' keyword"
    for key in _SCHEMA_MAPS:
        if key in s:
            v = s[key]
            if type(v) is not dict:
                return f'{_j(v)} is not of type "object"'
            for sub in v.values():
                err = _check(sub)
                if err:
                    return err
    for key in _SCHEMA_ARRAYS:
        if key in s:
            v = s[key]
            if type(v) is not list:
                return f'{_j(v)} is not of type "array"'
            if not v:
                return "[] has less than 1 item"
            for sub in v:
                err = _check(sub)
                if err:
                    return err
    for key in _SCHEMA_SINGLE:
        if key in s:
            err = _check(s[key])
            if err:
                return err
    if "required" in s:
        v = s["required"]
        if type(v) is not list:
            return f'{_j(v)} is not of type "array"'
        for x in v:
            if type(x) is not str:
                return f'{_j(x)} is not of type "string"'
    if "enum" in s and type(s["enum"]) is not list:
        return f'{_j(s["enum"])} is not of type "array"'
    for key in ("description", "title", "pattern", "format", "$ref"):
        if key in s and type(s[key]) is not str:
            return f'{_j(s[key])} is not of type "string"'
    for key in _NON_NEGATIVE:
        if key in s:
            v = s[key]
            if type(v) is not int or isinstance(v, bool):
                if not (type(v) is float and v.is_integer()):
                    return f'{_j(v)} is not of type "integer"'
            if v < 0:
                return f"{_j(v)} is less than the minimum of 0"
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        if key in s and (type(s[key]) not in (int, float)):
            return f'{_j(s[key])} is not of type "number"'
    if "pattern" in s:
        try:
            re.compile(s["pattern"])
        except (re.error, RecursionError, OverflowError, ValueError):
            # Python's regex parser recurses per nested group (RecursionError near 500 levels); the reference's
            # regex engine has a nesting limit too, and either way the pattern is not a usable regex.
            return f'{_j(s["pattern"])} is not a "regex"'
    return None


# -- strict normalization --------------------------------------------------------------------


class _Err(Exception):
    pass


def _unknown_variant(value: str, variants: tuple[str, ...]) -> _Err:
    return _Err(f"unknown variant `{value}`, expected one of {', '.join(f'`{v}`' for v in variants)}")


def _check_str_list(value: Any) -> None:
    """`_Err` unless `value` is a list of strings (serde's "a sequence" / "a string" messages)."""
    from ._serde import invalid_type

    if type(value) is not list:
        raise _Err(str(invalid_type(value, "a sequence")))
    for x in value:
        if type(x) is not str:
            raise _Err(str(invalid_type(x, "a string")))


def _opt_str(obj: dict, key: str) -> str | None:
    from ._serde import invalid_type

    v = obj.get(key)
    if v is None:
        return None
    if type(v) is not str:
        raise _Err(str(invalid_type(v, "a string")))
    return v


def _opt_number(obj: dict, key: str, integer: bool):
    from ._serde import invalid_type

    v = obj.get(key)
    if v is None:
        return None
    if integer:
        if type(v) is not int or v >= 2**63:
            raise _Err(str(invalid_type(v, "i64")))
        return v
    if type(v) not in (int, float):
        raise _Err(str(invalid_type(v, "a number")))
    return v


_TYPES = ("object", "string", "number", "integer", "boolean", "array", "null")
_SIMPLE = ("string", "number", "integer", "boolean", "null")
_FORMATS = ("email", "hostname", "ipv4", "ipv6", "uuid")


def _parse_schema(v: Any) -> dict:
    from ._serde import invalid_type

    if type(v) is dict and "type" in v and type(v["type"]) is list:
        types = []
        for t in v["type"]:
            if type(t) is not str:
                raise _Err(str(invalid_type(t, "variant identifier")))
            if t not in _SIMPLE:
                raise _unknown_variant(t, _SIMPLE)
            types.append(t)
        out: dict = {"type": types}
        d = _opt_str(v, "description")
        if d is not None:
            out["description"] = d
        return out
    if type(v) is dict and "type" in v:
        return _parse_type(v)
    if type(v) is dict and "anyOf" in v:
        items = v["anyOf"]
        if type(items) is not list:
            raise _Err(str(invalid_type(items, "a sequence")))
        out = {"anyOf": [_parse_type(x) for x in items]}
        d = _opt_str(v, "description")
        if d is not None:
            out["description"] = d
        return out
    if type(v) is dict and "$ref" in v:
        r = v["$ref"]
        if type(r) is not str:
            raise _Err(str(invalid_type(r, "a string")))
        return {"$ref": r}
    raise _Err("one of `type`, `anyOf`, `$ref` field is required")


def _parse_type(v: Any) -> dict:
    from ._serde import invalid_type

    if type(v) is not dict:
        raise _Err(str(invalid_type(v, "internally tagged enum JsonSchemaType")))
    if "type" not in v:
        raise _Err("missing field `type`")
    t = v["type"]
    if type(t) is not str:
        raise _Err(str(invalid_type(t, "variant identifier")))
    if t not in _TYPES:
        raise _unknown_variant(t, _TYPES)
    out: dict = {"type": t}
    if t == "object":
        props = v.get("properties")
        if props is not None:
            if type(props) is not dict:
                raise _Err(str(invalid_type(props, "a map")))
            props = {k: _parse_schema(x) for k, x in props.items()}
        ap = v.get("additionalProperties")
        if ap is not None and type(ap) is not bool:
            raise _Err(str(invalid_type(ap, "a boolean")))
        req = v.get("required")
        if req is not None:
            _check_str_list(req)
        out["properties"] = props
        out["additionalProperties"] = ap
        out["required"] = req
        d = _opt_str(v, "description")
        if d is not None:
            out["description"] = d
        defs = v.get("$def")
        if defs is not None:
            if type(defs) is not dict:
                raise _Err(str(invalid_type(defs, "a map")))
            out["$def"] = {k: _parse_schema(x) for k, x in defs.items()}
        return out
    d = _opt_str(v, "description")
    if d is not None:
        out["description"] = d
    if t == "string":
        for key in ("pattern",):
            x = _opt_str(v, key)
            if x is not None:
                out[key] = x
        f = v.get("format")
        if f is not None:
            if type(f) is not str:
                raise _Err(str(invalid_type(f, "variant identifier")))
            if f not in _FORMATS:
                raise _unknown_variant(f, _FORMATS)
            out["format"] = f
        e = v.get("enum")
        if e is not None:
            _check_str_list(e)
            out["enum"] = list(e)
    elif t in ("number", "integer"):
        for key in (
            "const",
            "default",
            "minimum",
            "maximum",
            "exclusiveMinimum",
            "exclusiveMaximum",
            "multipleOf",
        ):
            x = _opt_number(v, key, t == "integer")
            if x is not None:
                out[key] = x
    elif t == "array":
        if "items" not in v:
            raise _Err("missing field `items`")
        out = {"type": t, "items": _parse_schema(v["items"])}
        if d is not None:
            out["description"] = d
    return out


def _normalize(schema: dict, allow_empty_object: bool) -> None:
    if "anyOf" in schema:
        for item in schema["anyOf"]:
            _normalize_type(item, allow_empty_object)
    elif "$ref" in schema or type(schema.get("type")) is list:
        return
    else:
        _normalize_type(schema, allow_empty_object)


def _normalize_type(schema: dict, allow_empty_object: bool) -> None:
    t = schema["type"]
    if t == "object":
        props = schema["properties"] or {}
        if not allow_empty_object and not props:
            raise ConversionError("An object with no properties is not allowed.")
        for value in props.values():
            _normalize(value, False)
        for value in (schema.get("$def") or {}).values():
            _normalize(value, False)
        req = schema["required"]
        if req is not None:
            seen: set[str] = set()
            for key in req:
                if key not in props:
                    raise ConversionError(f"Required property '{key}' not found in object")
                if key in seen:
                    raise ConversionError(f"Duplicate required property '{key}'")
                seen.add(key)
            if len(seen) != len(props):
                raise ConversionError("Required properties must match all properties in the object")
        if schema["additionalProperties"] is True:
            raise ConversionError("additionalProperties should not be true")
        schema["required"] = list(props)
        schema["additionalProperties"] = False
        schema["properties"] = props
    elif t == "array":
        _normalize(schema["items"], False)


def _serialize(schema: dict) -> dict:
    # Re-order Object fields as the reference serializes them.
    if schema.get("type") == "object":
        out = {
            "type": "object",
            "properties": {k: _serialize(v) for k, v in (schema["properties"] or {}).items()}
            if schema["properties"] is not None
            else None,
            "additionalProperties": schema["additionalProperties"],
            "required": schema["required"],
        }
        if "description" in schema:
            out["description"] = schema["description"]
        if "$def" in schema:
            out["$def"] = {k: _serialize(v) for k, v in schema["$def"].items()}
        return out
    if schema.get("type") == "array":
        out = {"type": "array", "items": _serialize(schema["items"])}
        if "description" in schema:
            out["description"] = schema["description"]
        return out
    if "anyOf" in schema:
        out = {"anyOf": [_serialize(x) for x in schema["anyOf"]]}
        if "description" in schema:
            out["description"] = schema["description"]
        return out
    return schema


def default_strict_schema() -> dict:
    return {"type": "object", "properties": {}, "additionalProperties": False, "required": []}


def normalize_strict_schema(
    schema: Any, allow_empty_object: bool, error_prefix: str, top_level_error: str
) -> dict:
    try:
        parsed = _parse_schema(schema)
    except _Err as exc:
        raise ConversionError(f"{error_prefix}{exc}") from None
    _normalize(parsed, allow_empty_object)
    if parsed.get("type") != "object":
        raise ConversionError(top_level_error)
    return _serialize(parsed)
