"""The Airflow-facing pieces of isbflow, laid out like an Airflow provider package.

- ``hooks/``: connections to the outside systems (:class:`~isbflow.airflow.hooks.jetstream.JetStreamHook`,
  connection type ``nats``);
- ``operators/``: thin task wrappers over the library
  (:class:`~isbflow.airflow.operators.isb.IsbProvisionOperator`; in
  ``operators/pipeline.py`` ``PipelineStartOperator``, ``PipelineDrainOperator``,
  ``PipelineBatchOperator``; ``PipelineReplayOperator`` in ``operators/replay.py``,
  ``PipelineQualityOperator`` in ``operators/quality.py``, ``PipelineWatchdogOperator``
  in ``operators/watchdog.py``);
- ``sensors/``: :class:`~isbflow.airflow.sensors.pipeline.PipelineStateSensor`
  waits until every step reports a state, deferring to
- ``triggers/``: :class:`~isbflow.airflow.triggers.pipeline.PipelineStateTrigger`,
  which polls the step heartbeats in the triggerer (no worker slot held);
  ``PipelineLagSensor`` (``sensors/lag.py``) waits until every buffer's lag is
  at most N through ``PipelineLagTrigger`` (``triggers/lag.py``);
- ``pipelines``: where DAGs find spec files and the trigger-form parameter;
- ``catalog``: every pipeline under the pipelines folder, for DAGs generated per pipeline;
- ``assets``: sinks as Airflow Assets (``isbflow://<pipeline>/<sink>``) and their events.

Only this package imports Airflow; the core library (spec, isb, connector,
steps) never does, so Spark executors and the CLI stay light.
:func:`get_provider_info` registers the ``nats`` connection type with Airflow
(entry point ``apache_airflow_provider``).
"""

from __future__ import annotations


def get_provider_info() -> dict:
    """Provider metadata read by Airflow's ProvidersManager (connection types, hooks, operators)."""
    return {
        "package-name": "isbflow",
        "name": "isbflow",
        "description": "Streaming pipelines on NATS JetStream inter-step buffers and PySpark.",
        "versions": ["0.1.0"],
        "hooks": [{"integration-name": "isbflow",
                   "python-modules": ["isbflow.airflow.hooks.jetstream"]}],
        "operators": [{"integration-name": "isbflow",
                       "python-modules": ["isbflow.airflow.operators.isb",
                                          "isbflow.airflow.operators.pipeline",
                                          "isbflow.airflow.operators.replay",
                                          "isbflow.airflow.operators.quality",
                                          "isbflow.airflow.operators.watchdog"]}],
        "sensors": [{"integration-name": "isbflow",
                     "python-modules": ["isbflow.airflow.sensors.pipeline",
                                        "isbflow.airflow.sensors.lag"]}],
        "triggers": [{"integration-name": "isbflow",
                      "python-modules": ["isbflow.airflow.triggers.pipeline",
                                         "isbflow.airflow.triggers.lag"]}],
        "connection-types": [{
            "hook-class-name": "isbflow.airflow.hooks.jetstream.JetStreamHook",
            "connection-type": "nats",
            "hook-name": "NATS JetStream (isbflow ISB service)",
        }],
    }
