"""Numaflow's ``scale`` on a vertex, read with Numaflow's fields, defaults and bounds.

What a replica is here: a vertex's replicas are the task slots its query gets per micro-batch
and, on a cluster master (``spark://...``), the application's executors that run them. The
runner's autoscaler acts on ``scale`` as Numaflow's does (:mod:`isbflow.steps.autoscale`);
``disabled: true`` is Numaflow's way to say "no autoscaling". What it does not do, the loader
warns about (:func:`scale_warning`): a running step keeps at least one replica, so ``min: 0``
(scale to zero, the default) is not the step's autoscaler's to act on.

Numaflow's deprecated ``replicasPerScale``, ``cooldownSeconds`` and ``targetBufferUsage`` are
refused, naming their replacements (:mod:`isbflow.spec.numaflow`).
"""

from __future__ import annotations

from pydantic import Field, StrictBool, StrictInt, model_validator

from isbflow.spec.fields import SpecModel

#: Numaflow's defaults (docs/user-guide/reference/autoscaling.md)
MIN_REPLICAS = 0
MAX_REPLICAS = 50
LOOKBACK_S = 120
COOLDOWN_S = 90
ZERO_REPLICA_SLEEP_S = 120
TARGET_PROCESSING_S = 20
TARGET_BUFFER_AVAILABILITY = 50
REPLICAS_PER_SCALE = 2


class Scale(SpecModel):
    """Numaflow's autoscaling settings of one vertex (``scale``), with Numaflow's defaults.

    A replica is a task slot of the vertex's query per micro-batch, and on a cluster master an
    executor of the application. The runner's autoscaler acts on these (docs/autoscaling.md);
    ``isbflow pipeline advise`` computes the desired replicas with them too.
    """

    disabled: StrictBool = False
    """Numaflow autoscaling off for this vertex (its replicas stay as they are). Default false."""
    min: StrictInt = Field(default=MIN_REPLICAS, ge=0)
    """The fewest replicas (task slots per micro-batch; executors on a cluster master), 0 or more;
    0 lets the vertex scale to zero when nothing is pending. Default 0."""
    max: StrictInt = Field(default=MAX_REPLICAS, ge=1)
    """The most replicas, at least 1 and not below ``min``; ``min`` equal to ``max`` fixes the
    number. Default 50."""
    lookbackSeconds: StrictInt = Field(default=LOOKBACK_S, ge=1)
    """Seconds over which the processing rate (rows/s) and pending count are averaged. Default 120."""
    scaleUpCooldownSeconds: StrictInt = Field(default=COOLDOWN_S, ge=0)
    """Seconds after a change of replicas before the vertex may scale up again. Default 90."""
    scaleDownCooldownSeconds: StrictInt = Field(default=COOLDOWN_S, ge=0)
    """Seconds after a change of replicas before the vertex may scale down again. Default 90."""
    zeroReplicaSleepSeconds: StrictInt = Field(default=ZERO_REPLICA_SLEEP_S, ge=1)
    """Seconds a vertex scaled to zero waits before it looks at its input again. Default 120."""
    targetProcessingSeconds: StrictInt = Field(default=TARGET_PROCESSING_S, ge=1)
    """For a source vertex: seconds in which the replicas should work off what is pending
    (a larger value asks for fewer replicas). Default 20."""
    targetBufferAvailability: StrictInt = Field(default=TARGET_BUFFER_AVAILABILITY, ge=1, le=100)
    """For a udf or sink vertex: the percent (1 to 100) of its input buffer to keep free
    (a larger value asks for more replicas). Default 50."""
    replicasPerScaleUp: StrictInt = Field(default=REPLICAS_PER_SCALE, ge=1)
    """The most replicas one scale-up adds. Default 2."""
    replicasPerScaleDown: StrictInt = Field(default=REPLICAS_PER_SCALE, ge=1)
    """The most replicas one scale-down removes. Default 2."""

    @model_validator(mode="after")
    def _bounds(self) -> Scale:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not be above max ({self.max})")
        return self


def scale_warning(scale: Scale | None) -> str | None:
    """What ``isbflow validate`` says about a vertex's ``scale``: what the step's autoscaler does not
    act on. None when there is nothing to say (no ``scale``, ``disabled: true``, or ``min`` of 1 or more)."""
    if scale is None or scale.disabled or scale.min >= 1:
        return None
    return (f"scale.min 0 (scale to zero) is not acted on by the step's autoscaler: a running step keeps at least "
            f"1 replica and scales between 1 and {scale.max}; only a scale-to-zero watcher stops an idle pipeline's "
            "driver. Set scale.min: 1 (or scale.disabled: true) to silence this")
