"""The pipeline spec: typed models of ``InterStepBufferService`` and ``Pipeline``,
loaded and validated once with errors located as ``FILE: path.to.field: rule``."""

from isbflow.spec.load import SpecError, SpecProblem, Specs, load_specs
from isbflow.spec.models import InterStepBufferService, Pipeline

__all__ = ["InterStepBufferService", "Pipeline", "SpecError", "SpecProblem", "Specs", "load_specs"]
