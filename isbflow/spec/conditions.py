"""Numaflow's conditional forwarding in the spec: ``edges[].conditions.tags``.

A udf tags its records (a ``_tags`` column, :mod:`isbflow.steps.routing`); an edge
with ``conditions.tags`` takes only the records whose tags match, with Numaflow's
operators and default (``or``). Rules spanning vertices and edges (an edge leaving
a source cannot have conditions; ``onUnrouted`` needs a conditional out edge) are
in :mod:`isbflow.spec.graph`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import field_validator

from isbflow.spec.fields import SpecModel


class TagOperator(StrEnum):
    """Numaflow's ``conditions.tags.operator``: ``or`` (any value among the record's tags),
    ``and`` (every value among them), ``not`` (none of them)."""

    OR = "or"
    AND = "and"
    NOT = "not"


class TagConditions(SpecModel):
    """Numaflow's ``conditions.tags``: ``operator`` (default ``or``, as in Numaflow) over ``values``."""

    operator: TagOperator = TagOperator.OR
    """``or`` (any of ``values`` among the record's tags), ``and`` (all of them) or ``not`` (none of them).
    Default ``or``."""
    values: list[str]
    """The tags compared, at least one."""

    @field_validator("operator", mode="before")
    @classmethod
    def _operator(cls, v: Any) -> Any:
        if v not in {o.value for o in TagOperator}:
            raise ValueError(f"must be one of 'or', 'and', 'not' (Numaflow's operators, lower case), got {v!r}")
        return v

    @field_validator("values")
    @classmethod
    def _values(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must list at least one tag (an edge without conditions takes every record)")
        bad = [x for x in v if not isinstance(x, str) or not x.strip() or "\n" in x]
        if bad:
            raise ValueError(f"tags must be non-empty strings on one line, got {bad!r}")
        return v


class ForwardConditions(SpecModel):
    """Numaflow's ``edges[].conditions``: conditional forwarding by the tags a transform sets."""

    tags: TagConditions
    """Which records the edge takes, by the tags the upstream transform set."""
