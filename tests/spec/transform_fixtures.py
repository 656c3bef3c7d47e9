"""Transforms for the specs tests/spec/test_transforms.py writes: they declare this module in
``transformPackages`` (a spec outside the project's packages may use only what it declares)."""

from __future__ import annotations

NOT_A_FUNCTION = 3


def passthrough(df, **references):
    """Any references, by name."""
    return df


def with_services(df, services):
    return df.join(services, "service", "left")
