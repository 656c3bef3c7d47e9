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
:func:`get_provider_info` makes isbflow an Airflow provider: the entry point
``apache_airflow_provider`` in ``pyproject.toml`` names it, so ``airflow providers list``
shows isbflow and the connection form offers the ``nats`` type with its fields.
"""

from __future__ import annotations

from isbflow import __version__

#: the ``nats`` connection's extra fields, as the connection form shows them (read by
#: :class:`~isbflow.airflow.hooks.jetstream.JetStreamHook`)
NATS_CONN_FIELDS = {
    "servers": {"label": "Servers", "description": "NATS URLs, comma separated (nats://n1:4222,nats://n2:4222); "
                                                   "over Host and Port when set.",
                "schema": {"type": ["string", "null"]}},
    "token": {"label": "Token", "description": "A token, instead of Login and Password.",
              "schema": {"type": ["string", "null"], "format": "password"}},
    "creds_file": {"label": "Credentials file", "description": "A NATS .creds file (JWT and NKey seed).",
                   "schema": {"type": ["string", "null"]}},
    "tls_ca": {"label": "TLS CA file", "description": "The CA certificate (PEM) the server is checked against.",
               "schema": {"type": ["string", "null"]}},
    "tls_cert": {"label": "TLS client certificate", "description": "A client certificate (PEM).",
                 "schema": {"type": ["string", "null"]}},
    "tls_key": {"label": "TLS client key", "description": "The private key (PEM) of the client certificate.",
                "schema": {"type": ["string", "null"]}},
    "tls_insecure": {"label": "Skip TLS verification", "description": "Do not check the server's certificate.",
                     "schema": {"type": ["boolean", "null"], "default": False}},
}


def get_provider_info() -> dict:
    """Provider metadata read by Airflow's ProvidersManager (entry point ``apache_airflow_provider``):
    the ``nats`` connection type with its form (fields, labels, placeholders), the hooks, operators,
    sensors and triggers. Imports nothing of Airflow's."""
    return {
        "package-name": "isbflow",
        "name": "isbflow",
        "description": "Streaming pipelines on NATS JetStream inter-step buffers and PySpark.",
        "versions": [__version__],
        "hooks": [{"integration-name": "isbflow",
                   "python-modules": ["isbflow.airflow.hooks.jetstream"]}],
        "operators": [{"integration-name": "isbflow",
                       "python-modules": ["isbflow.airflow.operators.isb",
                                          "isbflow.airflow.operators.pipeline",
                                          "isbflow.airflow.operators.replay",
                                          "isbflow.airflow.operators.quality",
                                          "isbflow.airflow.operators.sinks",
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
            "conn-fields": NATS_CONN_FIELDS,
            "ui-field-behaviour": {
                "hidden-fields": ["schema"],
                "relabeling": {"host": "Server(s)", "login": "User"},
                "placeholders": {"host": "127.0.0.1  or  nats://n1:4222,nats://n2:4222", "port": "4222"},
            },
        }],
    }
