"""The quality jobs' one error: a sink that cannot be checked (no table yet, no quality suite ...)."""

from __future__ import annotations


class QualityError(Exception):
    """A quality run cannot start: no such sink, no table yet, ...; the message says what to do."""
