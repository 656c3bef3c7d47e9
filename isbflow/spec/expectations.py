"""GX expectations by name: is a name registered, do its arguments construct it.

GX Core 1.x expectations are (pydantic v1) models registered by snake-case
name (``expect_column_values_to_not_be_null`` -> ``ExpectColumnValuesToNotBeNull``).
The spec names them that way. Two levels of checking:

- :func:`catalog_problems` (spec validation, every ``load_specs``): the name is
  registered and the argument names are known and complete, against
  ``gx_catalog.json``, a catalog generated from GX's registry
  (:func:`build_catalog`; a test keeps it equal to the installed GX). Importing
  GX takes seconds (much more on a busy machine), too slow for every spec load,
  DAG parse and CLI call; when the installed GX version is not the catalog's,
  the registry itself is used.
- :func:`kwargs_problems` (``isbflow quality check`` and every quality run):
  the arguments construct the GX class, so values are checked too (types,
  ``mostly <= 1``, ``min_value``/``max_value`` not both null ...).
"""

from __future__ import annotations

import difflib
import functools
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from isbflow.spec.errors import SpecProblem

_CATALOG = Path(__file__).with_name("gx_catalog.json")

#: Fields every GX expectation has that a spec has no business setting.
_INTERNAL_FIELDS = frozenset({"id", "meta", "notes", "result_format", "description", "catch_exceptions",
                              "rendered_content", "severity", "windows", "batch_id"})


@functools.cache
def registered_expectations() -> dict[str, type]:
    """GX's registered expectation classes by snake-case name."""
    # lazy: great_expectations takes seconds to import; specs load in every command and DAG parse
    import great_expectations.expectations  # noqa: F401 - registers the core expectations
    from great_expectations.expectations.registry import _registered_expectations

    return dict(_registered_expectations)


def build_catalog() -> dict[str, dict[str, list[str]]]:
    """Name -> allowed and required arguments, from GX's registry (imports GX)."""
    out = {}
    for name, cls in sorted(registered_expectations().items()):
        fields = {n: f for n, f in cls.__fields__.items() if n not in _INTERNAL_FIELDS}
        out[name] = {"arguments": list(fields), "required": [n for n, f in fields.items() if f.required]}
    return out


@functools.cache
def catalog() -> dict[str, dict[str, list[str]]]:
    """The shipped catalog when it matches the installed GX, else one built from GX."""
    try:
        data = json.loads(_CATALOG.read_text(encoding="utf-8"))
        if data.get("gx_version") == version("great-expectations"):
            return data["expectations"]
    except (OSError, ValueError, PackageNotFoundError):
        pass
    return build_catalog()


def catalog_problems(name: str, kwargs: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) problems of one spec expectation, without importing GX.

    ``field`` is ``expectation`` or ``kwargs.<argument>``.
    """
    known = catalog()
    if name not in known:
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else " (see the GX expectation gallery for the names)"
        return [("expectation", f"unknown GX expectation {name!r}{hint}")]
    allowed, required = known[name]["arguments"], known[name]["required"]
    out = []
    for key in kwargs:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}"
            out.append((f"kwargs.{key}", f"not an argument of {name} ({hint})"))
    out += [(f"kwargs.{r}", f"required by {name}") for r in required if r not in kwargs]
    return out


def unknown_expectation_message(name: str) -> str | None:
    """None when ``name`` is a registered GX expectation, else what to write instead."""
    known = registered_expectations()
    if name in known:
        return None
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else " (see the GX expectation gallery for the names)"
    return f"unknown GX expectation {name!r}{hint}"


def arguments(name: str) -> list[str]:
    """The arguments a spec may give expectation ``name``."""
    return [f for f in registered_expectations()[name].__fields__ if f not in _INTERNAL_FIELDS]


def kwargs_problems(name: str, kwargs: dict[str, Any]) -> list[str]:
    """What is wrong with ``kwargs`` for expectation ``name`` (empty: it constructs)."""
    # lazy: great_expectations takes seconds to import; specs load in every command and DAG parse
    from great_expectations.compatibility.pydantic import ValidationError

    cls = registered_expectations()[name]
    allowed = arguments(name)
    problems: list[str] = []
    for key in kwargs:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}"
            problems.append(f"{key}: not an argument of {name} ({hint})")
    if problems:
        return problems
    try:
        cls(**kwargs)
    except ValidationError as e:
        seen: set[str] = set()
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            if field in seen:  # a union type fails once per member: the first says enough
                continue
            seen.add(field)
            if err["type"] == "value_error.missing":
                problems.append(f"{field}: required by {name}")
            elif field == "__root__":
                problems.append(f"{name}: {err['msg']}")
            else:
                problems.append(f"{field}: {err['msg']}, got {kwargs.get(field)!r}")
    except (TypeError, ValueError) as e:  # some expectations check in __init__
        problems.append(f"{name}: {e}")
    return problems


def build_expectation(name: str, kwargs: dict[str, Any]):
    """The GX expectation object (the spec has already checked the arguments)."""
    return registered_expectations()[name](**kwargs)


def check_expectations(specs) -> list:
    """Construct every expectation of every pipeline's ``quality`` (imports GX).

    Returns :class:`isbflow.spec.load.SpecProblem` items located by file and
    field (``quality[0].expectations[1].kwargs.mostly``), empty when all build.
    """
    problems = []
    for name, p in specs.pipelines.items():
        file = specs.files.get(f"Pipeline/{name}", "?")
        for i, q in enumerate(p.spec.quality):
            for j, e in enumerate(q.expectations):
                where = f"quality[{i}].expectations[{j}]"
                message = unknown_expectation_message(e.expectation)
                if message:
                    problems.append(SpecProblem(file, f"{where}.expectation", message))
                    continue
                for text in kwargs_problems(e.expectation, e.kwargs):
                    field, _, rest = text.partition(": ")
                    path = f"{where}.kwargs.{field}" if field in e.kwargs or field in arguments(e.expectation) \
                        else f"{where}.kwargs"
                    problems.append(SpecProblem(file, path, rest if path.endswith(field) else text))
    return problems
