"""A vertex's transform, ``module:function``, resolved to the callable it names."""

from __future__ import annotations

import importlib
from collections.abc import Callable


class TransformError(Exception):
    """A transform entry that does not name an importable callable; the message names the entry."""


def load_transform(entry: str) -> Callable:
    """The callable ``module:function`` names (``spark_apps.logs:parse``)."""
    module, _, func = entry.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise TransformError(f"cannot load transform {entry!r}: {e}") from None
