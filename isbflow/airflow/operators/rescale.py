"""The operator that changes how many partitions the buffers into a vertex have.

:class:`PipelineRescaleOperator` calls :func:`isbflow.ops.rescale.rescale` (imported when
the task runs: parsing a DAG file stays light), the same function as ``isbflow pipeline
rescale``: it checks the spec already says ``partitions: N`` on the vertex, drains the
pipeline when its driver runs, refuses when a partition still holds unread messages (unless
``force``) or the vertex keeps state, creates and removes partitions, and starts the pipeline
again. XCom: what it did (:meth:`isbflow.ops.rescale.Rescaled.to_json`). A refusal fails the
task without retries, naming why; an unreachable ISB service may pass on retry.

The spec is found like the other pipeline tasks (a file name under ``pipelines_dir``), the ISB
service through ``JetStreamHook`` (``nats_default``, else the embedded server), the state in
``data_dir`` (default ``ISBFLOW_HOME``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from isbflow.airflow.operators.isb import as_bool
from isbflow.airflow.operators.pipeline import PipelineOperatorBase


class PipelineRescaleOperator(PipelineOperatorBase):
    """Re-partition the buffers into ``vertex`` to the count the spec says; XCom: what was done.

    :param vertex: the vertex whose input buffers change.
    :param partitions: the count asked for; the spec must already say it (a check, not a change).
    :param force: re-partition even when partitions hold unread messages (those removed are lost).
    :param drain_timeout: seconds the drain before the change may take.
    :param master: Spark master of the restarted driver (default: the one it ran with).
    :param workdir: the restarted driver's working directory (user transforms).
    """

    template_fields: Sequence[str] = (*PipelineOperatorBase.template_fields, "vertex", "partitions", "force",
                                      "drain_timeout", "master", "workdir")
    ui_color = "#c7e0f0"

    def __init__(self, *, vertex: str, partitions: int | str, force: bool | str = False,
                 drain_timeout: float | str = 300.0, master: str | None = None, workdir: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.vertex = vertex
        self.partitions = partitions
        self.force = force
        self.drain_timeout = drain_timeout
        self.master = master
        self.workdir = workdir

    def execute(self, context: Any) -> dict:
        # lazy: ops.rescale loads pyarrow and nats-py (~0.3 CPU-s); DAG parsing must not (it reruns every 30 s)
        from isbflow.ops import rescale as ops

        t = self.target()
        try:
            partitions = int(self.partitions)
        except ValueError:
            raise AirflowFailException(f"partitions: expected a whole number, got {self.partitions!r}") from None
        try:
            out = ops.rescale(t.path, t.specs, t.pipeline, str(self.vertex), t.settings, t.data_dir,
                              partitions=partitions, force=as_bool(self.force),
                              drain_timeout=float(self.drain_timeout), master=self.master or None,
                              workdir=Path(self.workdir) if self.workdir else None,
                              references_dir=self.references_dir(), progress=self.log.info)
        except ops.IsbUnreachable as e:
            raise RuntimeError(str(e)) from None  # retries apply
        except (ops.RescaleError, ops.DrainTimeout) as e:
            raise AirflowFailException(str(e)) from None
        self.log.info("pipeline %s: buffers into %s: %s -> %s partition(s); created %s, removed %s, in %.1fs",
                      out.pipeline, out.vertex, out.before, out.after, out.created or "none",
                      out.removed or "none", out.seconds)
        return out.to_json()
