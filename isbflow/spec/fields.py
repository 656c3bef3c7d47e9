"""The spec's value types, shared by both kinds: names, sizes, durations, paths, the base model.

Each turns a YAML value into a checked Python value or raises ``ValueError`` with a
message for the user (the loader, :mod:`isbflow.spec.load`, adds file, field and line).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from isbflow.spec.names import NAME_PATTERN
from isbflow.spec.times import parse_duration

# Every pattern here ends in ``\Z``: ``$`` also matches before a final newline.
NAME_RE = re.compile(NAME_PATTERN)
#: partitions of one vertex: each is a stream (and a Spark read task); more is a typo, not a design
MAX_PARTITIONS = 64

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}


def parse_size(value: Any) -> int:
    """``"64MiB"`` -> 67108864; ``-1`` means unlimited where the field allows it."""
    if isinstance(value, bool):
        raise ValueError("must be a size in bytes such as 1048576 or '1MiB'")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if value < -1:
            raise ValueError(f"must be a size >= 0 (or -1 for unlimited), got {value!r}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])
        if value.strip() == "-1":
            return -1
    raise ValueError(f"must be a size in bytes such as 1048576 or '1MiB', got {value!r}")


#: written as a Go-style string (``72h``, ``30s``, ``1m30s``) or a number of seconds; held as float seconds
Duration = Annotated[float, BeforeValidator(parse_duration, json_schema_input_type=float | str)]
#: written as bytes or a string with a unit (``64MiB``, ``1GB``); held as int bytes
Size = Annotated[int, BeforeValidator(parse_size, json_schema_input_type=int | str)]


class SpecModel(BaseModel):
    """Strict-ish base: unknown fields are errors; values are checked, not coerced wildly.

    A field's description is the docstring right below it (it shows in ``isbflow spec schema``
    and in editors that read the schema)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, use_attribute_docstrings=True)


def check_name(value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError(
            f"{value!r} is not a valid name: use lowercase letters, digits and '-', "
            "start and end with a letter or digit, at most 48 characters"
        )
    return value


#: :data:`NAME_PATTERN` in JSON Schema's dialect (no ``\Z``; a schema's ``$`` has no newline exception)
JSON_NAME_PATTERN = NAME_PATTERN.removesuffix(r"\Z") + "$"
Name = Annotated[str, BeforeValidator(lambda v: check_name(v) if isinstance(v, str) else v,
                                      json_schema_input_type=Annotated[str, Field(pattern=JSON_NAME_PATTERN)])]


def check_path(value: str) -> str:
    """A sink table or landing folder: relative ones live under the data dir, so no ``..``
    segment may leave it; no leading ``-`` (never read as an option) and no control characters."""
    if not value.strip():
        raise ValueError("must not be empty")
    if value.startswith("-"):
        raise ValueError(f"{value!r} must not start with '-'")
    if any(not c.isprintable() for c in value):
        raise ValueError(f"{value!r} holds control characters")
    if ".." in re.split(r"[/\\]", value):
        raise ValueError(f"{value!r} must not contain '..' (relative paths stay under the data dir)")
    return value


def is_absolute(path: str) -> bool:
    return path.startswith(("/", "\\")) or bool(re.match(r"^[A-Za-z]:", path)) or "://" in path


SafePath = Annotated[str, BeforeValidator(lambda v: check_path(v) if isinstance(v, str) else v)]


def one_of_message(what: str, allowed: tuple[str, ...], found: list[str]) -> str:
    need = f"{what} needs exactly one of: {', '.join(allowed)}"
    if not found:
        return f"{need} (found none)"
    return f"{need} (found {' and '.join(repr(f) for f in found)})"


class Metadata(SpecModel):
    """Kubernetes-style object metadata, as in Numaflow."""

    name: Name
    """The object's name: lowercase letters, digits and '-', starting and ending with a letter or digit,
    at most 48 characters. It ends up in stream names, subjects and paths."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Free-form string labels; kept with the spec, not used by isbflow. Default: none."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Free-form string annotations; kept with the spec, not used by isbflow. Default: none."""
