"""Argument values written as text (XML parameters, Python literals) turned into JSON values,
by the JSON Schema type of the tool's parameter when the request's tools give one."""

from __future__ import annotations

import ast
import functools
import json

# What an argument written as text can become, tried in order, for each JSON Schema type.
_NUMBER_TYPES = ("integer", "number")


def _as_json_text(value: str) -> object:
    """`value` as a JSON (or, failing that, Python literal) object or array; else the text."""
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        pass
    try:
        literal = ast.literal_eval(value)  # never eval: literals only
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
    return literal if _is_json(literal) else value


def _is_json(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _convert_one(value: str, json_type: str) -> tuple[bool, object]:
    """(whether `value` reads as `json_type`, what it reads as)."""
    text = value.strip()
    if json_type in _NUMBER_TYPES:
        try:
            number = json.loads(text)
        except ValueError:
            return False, None
        ok = isinstance(number, int | float) and not isinstance(number, bool)
        return ok and (json_type == "number" or isinstance(number, int)), number
    if json_type == "boolean":
        lowered = text.lower()
        return lowered in ("true", "false"), lowered == "true"
    if json_type == "null":
        return text.lower() in ("null", "none"), None
    if json_type in ("object", "array"):
        converted = _as_json_text(text)
        expected = dict if json_type == "object" else list
        return isinstance(converted, expected), converted
    return json_type == "string", value


def convert_text(value: str, schema_type: object) -> object:
    """A parameter written as text, as its schema type; the text itself when no type fits
    (or the tool, or the parameter, or its type, is unknown)."""
    types = schema_type if isinstance(schema_type, list) else [schema_type]
    for json_type in types:
        if isinstance(json_type, str) and json_type != "string":
            ok, converted = _convert_one(value, json_type)
            if ok:
                return converted
    return value


# The scanners read the whole output again at each piece: an argument already whole is read
# once. (Callers only serialize the value, so sharing it is safe.)
@functools.lru_cache(maxsize=256)
def literal_value(source: str) -> object:
    """A Python literal argument (`"Paris"`, `3`, `True`, `[1, 2]`) as a JSON value; its
    source text when it is not a literal that JSON can hold."""
    try:
        value = ast.literal_eval(source.strip())  # never eval: literals only
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return source.strip()
    return value if _is_json(value) else source.strip()
