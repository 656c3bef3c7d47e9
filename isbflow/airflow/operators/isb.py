"""Operators for the ISB service: provisioning a pipeline's buffers.

``IsbProvisionOperator`` loads a spec file, connects through
:class:`~isbflow.airflow.hooks.jetstream.JetStreamHook` and runs
:func:`isbflow.isb.provision.apply` (idempotent: creates what is missing,
updates what JetStream updates in place, and with ``recreate`` rebuilds what
it cannot; ``force`` allows recreating buffers that still hold data). The
report table goes to the task log and the report JSON is the return value
(XCom ``return_value``).

Outcomes: buffers that differ from the spec in a field JetStream cannot change
in place (``drift``) are logged as a warning and listed in the report (the task
succeeds: nothing was lost, re-run with ``recreate``); a recreate refused because
the buffer holds messages fails the task, as do a bad spec and a server refusal
(without retries: retrying cannot fix them). An unreachable server fails the
attempt normally, so retries apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from isbflow.airflow.hooks.jetstream import JetStreamHook
from isbflow.airflow.pipelines import resolve_pipeline_file
from isbflow.ops import isb as ops_isb
from isbflow.spec import SpecError, load_specs

if TYPE_CHECKING:
    from isbflow.ops.isb import ProvisionReport

_TRUE = {"1", "true", "yes", "on"}


def as_bool(value: Any) -> bool:
    """A templated flag: ``"{{ params.x }}"`` renders to the string ``"True"``/``"False"``."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)


class IsbProvisionOperator(BaseOperator):
    """Create or update the ISB buffers (streams, KV buckets) of the pipeline(s) in a spec file.

    :param pipeline_file: spec file; a relative name is looked up under ``pipelines_dir``.
    :param pipelines_dir: folder of spec files (default: the current directory).
    :param pipeline: the pipeline to provision when the file holds several (default: all).
    :param nats_conn_id: Airflow connection of the ISB service (falls back to the
        embedded server when undefined; see ``JetStreamHook``).
    :param recreate: rebuild buffers whose config JetStream cannot change in place.
    :param force: allow ``recreate`` to drop buffers that still hold messages.
    """

    template_fields: Sequence[str] = ("pipeline_file", "pipelines_dir", "pipeline", "nats_conn_id",
                                      "recreate", "force")
    ui_color = "#c7e3f0"

    def __init__(
        self,
        *,
        pipeline_file: str,
        pipelines_dir: str | None = None,
        pipeline: str | None = None,
        nats_conn_id: str = JetStreamHook.default_conn_name,
        recreate: bool | str = False,
        force: bool | str = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pipeline_file = pipeline_file
        self.pipelines_dir = pipelines_dir
        self.pipeline = pipeline
        self.nats_conn_id = nats_conn_id
        self.recreate = recreate
        self.force = force

    def execute(self, context: Any) -> dict:
        try:
            path = resolve_pipeline_file(self.pipeline_file, self.pipelines_dir or Path.cwd())
            specs = load_specs([path])
        except (FileNotFoundError, SpecError) as e:
            raise AirflowFailException(str(e)) from None
        pipeline = self.pipeline or None
        service = _service(specs, pipeline)
        settings = JetStreamHook(self.nats_conn_id).get_settings(service)
        recreate, force = as_bool(self.recreate), as_bool(self.force)
        self.log.info("provisioning %s (pipeline=%s, recreate=%s, force=%s) on %s",
                      path, pipeline or "all", recreate, force, settings.display)
        try:
            report = ops_isb.apply(settings, specs, pipeline, recreate=recreate, force=force)
        except ops_isb.Unreachable as e:
            raise RuntimeError(str(e)) from None
        except (SpecError, ops_isb.ProvisionError) as e:
            raise AirflowFailException(str(e)) from None
        self.log.info("pipeline %s, changed: %s\n%s", report.pipeline, report.changed, report_table(report))
        refused = [r for r in report.resources if r.action == ops_isb.Action.REFUSED]
        for r in report.pending:
            self.log.warning("%s %s: %s: %s", r.kind, r.name, r.action.value, r.message)
        if refused:
            raise AirflowFailException(
                f"recreate refused for {len(refused)} buffer(s) still holding messages "
                f"({', '.join(r.name for r in refused)}): drain the pipeline first, or trigger again with force")
        return report.to_json()


def _service(specs: Any, pipeline: str | None) -> Any:
    """The ISB service spec the hook's fallback uses (the pipeline's, else the only one)."""
    if pipeline and pipeline in specs.pipelines:
        return specs.service_for(specs.pipelines[pipeline])
    if len(specs.pipelines) == 1:
        return specs.service_for(next(iter(specs.pipelines.values())))
    if len(specs.services) == 1:
        return next(iter(specs.services.values()))
    return None


def report_table(report: ProvisionReport) -> str:
    """The report as a plain-text table for the task log: one row per stream or bucket."""
    rows = [("RESOURCE", "KIND", "ACTION", "DETAIL")]
    for r in report.resources:
        detail = "; ".join([str(c) for c in r.changes] + ([r.message] if r.message else []))
        rows.append((r.name, r.kind, r.action.value, detail))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}".rstrip()
                     for a, b, c, d in rows)
