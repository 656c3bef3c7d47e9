"""The pipeline spec: typed models of ``InterStepBufferService`` and ``Pipeline``,
loaded and validated once with errors located as ``FILE: path.to.field: rule``.

The package's names are loaded on first use (PEP 562): Spark's Python workers import
:mod:`isbflow.spec.derived` (buffer and bucket names) through the connector, and must not pay
for the models and the YAML loader (pydantic, yaml: ~0.3 CPU-seconds per worker process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from isbflow.spec.load import SpecError, SpecProblem, Specs, load_specs
    from isbflow.spec.models import InterStepBufferService, Pipeline

__all__ = ["InterStepBufferService", "Pipeline", "SpecError", "SpecProblem", "Specs", "load_specs"]

_HOME = {"InterStepBufferService": "isbflow.spec.models", "Pipeline": "isbflow.spec.models",
         "SpecError": "isbflow.spec.load", "SpecProblem": "isbflow.spec.load", "Specs": "isbflow.spec.load",
         "load_specs": "isbflow.spec.load"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'isbflow.spec' has no attribute {name!r}")
