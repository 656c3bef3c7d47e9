"""Pydantic's validation errors worded for a data engineer: the field's path in the
document (``vertices[2].partitions``), the rule broken, the value as written (cut
short, never the repr of a huge value), and a hint only when a name is genuinely close.
"""

from __future__ import annotations

import difflib
import re
import reprlib
from collections.abc import Sequence
from typing import Any, get_args

from pydantic import BaseModel

from isbflow.spec import numaflow

Loc = tuple[str | int, ...]

#: how close an unknown name must be to a known one to be suggested (difflib ratio)
HINT_CUTOFF = 0.8


def field_path(loc: Loc) -> str:
    """``("spec", "vertices", 2, "partitions")`` -> ``vertices[2].partitions``."""
    if len(loc) > 1 and loc[0] == "spec":
        loc = loc[1:]
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 57
_REPR.maxlist = _REPR.maxdict = 6
_REPR.maxlevel = 2


def shown(value: Any) -> str:
    """A value as the user wrote it, cut to about 60 characters (never the repr of a huge value)."""
    text = _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_TYPE_RULES = {
    "int": "must be an integer",
    "float": "must be a number",
    "string": "must be a string",
    "bool": "must be true or false",
    "list": "must be a list",
    "dict": "must be a mapping",
    "model": "must be a mapping",
    "model_attributes": "must be a mapping",
}


def describe(err: dict[str, Any], model: type[BaseModel]) -> tuple[Loc, str]:
    """A pydantic error as (location in the document, message worded for the user)."""
    # pydantic puts the failing union member / validator into loc for some
    # error types ("function-after[...]", "str"); keep only field names.
    loc: Loc = tuple(p for p in err["loc"]
                     if isinstance(p, int) or ("[" not in p and not p.startswith("function")))
    kind: str = err["type"]
    msg: str = err["msg"]
    got = f", got {shown(err.get('input'))}"
    if kind == "extra_forbidden":
        name = str(loc[-1]) if loc else "?"
        msg = f"unknown field {name!r}"
        at = model_at(model, loc[:-1])
        known = [f.alias or n for n, f in at.model_fields.items()] if at is not None else []
        refused = numaflow.refused_field(at.__name__, name) if at is not None else None
        close = difflib.get_close_matches(name, known, n=1, cutoff=HINT_CUTOFF)
        if refused:
            msg = refused
        elif close:
            msg += f" (did you mean {close[0]!r}?)"
        elif known:
            msg += f" (allowed: {', '.join(sorted(known))})"
    elif kind == "missing":
        msg = "required field is missing"
    elif kind in ("value_error", "assertion_error"):
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    elif kind in ("literal_error", "enum"):
        expected = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        msg = f"must be one of {', '.join(repr(e) for e in expected)}{got}"
        hint = suggest(err.get("input"), expected)
        if hint:
            msg += f" (did you mean {hint!r}?)"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
              "less_than": "<"}[kind]
        bound = next(iter(err.get("ctx", {}).values()), "?")
        msg = f"must be {op} {bound}{got}"
    elif kind.removesuffix("_type").removesuffix("_parsing").removesuffix("_from_float") in _TYPE_RULES:
        msg = _TYPE_RULES[kind.removesuffix("_type").removesuffix("_parsing").removesuffix("_from_float")] + got
    else:
        msg = msg[:1].lower() + msg[1:] + got
    return loc, msg


def suggest(value: Any, allowed: Sequence[str]) -> str | None:
    if not isinstance(value, str):
        return None
    for a in allowed:
        if a.lower() == value.lower():
            return a
    close = difflib.get_close_matches(value, list(allowed), n=1, cutoff=HINT_CUTOFF)
    return close[0] if close else None


def model_at(model: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The model class at ``loc`` inside ``model`` (fields by alias), None when there is none."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        f = next((f for n, f in current.model_fields.items() if (f.alias or n) == part), None)
        if f is None:
            return None
        current = model_of(f.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return current
    return None


def model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = model_of(arg)
        if found is not None:
            return found
    return None
