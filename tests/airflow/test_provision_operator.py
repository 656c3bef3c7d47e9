"""The ``isb_provision`` DAG, ``IsbProvisionOperator`` and ``JetStreamHook`` against a real nats-server.

DAG runs use ``dag.test()`` in a subprocess over a migrated temporary AIRFLOW_HOME
(tests/helpers/airflow_env.py); the connection comes from ``AIRFLOW_CONN_NATS_DEFAULT``.
"""

from __future__ import annotations

import asyncio
import json

import nats.errors
import pytest

from isbflow.airflow.hooks.jetstream import JetStreamHook, settings_from_connection
from isbflow.isb import provision
from isbflow.isb.connect import connect
from isbflow.isb.server import free_port
from isbflow.platform import nats_connection_json
from isbflow.spec import load_specs
from tests.helpers.provision import small_demo  # noqa: F401

pytestmark = pytest.mark.slow


def _no_fallback(tmp_path) -> dict[str, str]:
    """Env where the hook's fallback finds nothing: only the connection can lead to the server."""
    return {"ISBFLOW_HOME": str(tmp_path / "empty"), "NATS_URL": ""}


def test_dag_provisions_logs_pipeline_idempotently(airflow_home, nats_server, tmp_path):
    folder = small_demo(tmp_path)
    env = {**_no_fallback(tmp_path), "AIRFLOW_CONN_NATS_DEFAULT": nats_connection_json(nats_server.state),
           "ISBFLOW_PIPELINES_DIR": str(folder)}
    specs = load_specs([folder / "logs.yaml"])

    first = airflow_home.run_dag("isb_provision", {"pipeline": "logs.yaml"}, extra_env=env)
    assert first.state == "success", first.output[-4000:]
    report = first.xcom["provision"]
    assert report["pipeline"] == "logs" and report["changed"] is True
    assert {r["action"] for r in report["resources"]} == {"created"}

    statuses = asyncio.run(provision.status(nats_server.settings, specs, "logs"))
    assert statuses and all(s.exists for s in statuses)
    assert {s.name for s in statuses} == {r["name"] for r in report["resources"]}

    second = airflow_home.run_dag("isb_provision", {"pipeline": "logs.yaml", "recreate": False},
                                  extra_env=env)
    assert second.state == "success", second.output[-4000:]
    assert second.xcom["provision"]["changed"] is False
    assert {r["action"] for r in second.xcom["provision"]["resources"]} == {"unchanged"}
    assert nats_server.state.password not in first.output + second.output


def test_unreachable_server_fails_task_without_leaking_password(airflow_home, tmp_path):
    secret = "s3cret-never-logged-42"
    port = free_port()  # nothing listens there
    conn = json.dumps({"conn_type": "nats", "host": "127.0.0.1", "port": port,
                       "login": "isbflow", "password": secret})
    env = {**_no_fallback(tmp_path), "AIRFLOW_CONN_NATS_DEFAULT": conn}

    result = airflow_home.run_dag("isb_provision", {"pipeline": "logs.yaml"}, extra_env=env)

    assert result.state == "failed"
    assert result.tasks == {"provision": "failed"}
    assert f"cannot reach the ISB service at nats://127.0.0.1:{port}" in result.output
    assert secret not in result.output


def test_hook_falls_back_to_embedded_server_without_connection(nats_server, monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_NATS_DEFAULT", raising=False)
    monkeypatch.delenv("NATS_URL", raising=False)
    hook = JetStreamHook("nats_default", data_dir=nats_server.data_dir)

    settings = hook.get_settings()

    assert settings.servers == nats_server.settings.servers
    ok, message = hook.test_connection()
    assert ok, message


def test_readers_use_the_reader_connection_when_defined(nats_server, monkeypatch):
    """The UI reads with ``nats_reader`` (the platform defines it with the embedded ``reader`` user,
    who may publish nothing); without it, the default connection."""
    from isbflow.airflow.hooks.jetstream import reader_settings
    from isbflow.platform import nats_connection_json

    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_NATS_DEFAULT", nats_connection_json(nats_server.state))
    monkeypatch.delenv("AIRFLOW_CONN_NATS_READER", raising=False)
    assert reader_settings(nats_server.data_dir).user == "isbflow"
    monkeypatch.setenv("AIRFLOW_CONN_NATS_READER", nats_connection_json(nats_server.state, "reader"))
    settings = reader_settings(nats_server.data_dir)
    assert settings.user == "reader" and settings.inbox_prefix is None  # set from the user at connect

    async def go() -> None:
        nc = await connect(settings)
        try:
            assert (await nc.jetstream().account_info()).streams == 0  # may read metadata
            with pytest.raises(nats.errors.TimeoutError):  # may not create a stream
                await nc.request("$JS.API.STREAM.CREATE.x", b"{\"name\": \"x\"}", timeout=2)
        finally:
            await nc.close()

    asyncio.run(go())


def test_hook_reads_connection_fields():
    from airflow.sdk import Connection

    conn = Connection.from_json(json.dumps({
        "conn_type": "nats", "host": "n1:4223,n2", "port": 4300, "login": "u", "password": "pw",
        "extra": {"token": "t", "creds_file": "/c.creds", "tls_ca": "/ca.pem", "tls_insecure": "true"},
    }), conn_id="x")
    s = settings_from_connection(conn)
    assert s.servers == ("nats://n1:4223", "nats://n2:4300")
    assert (s.user, s.password, s.token, s.creds_file, s.tls_ca, s.tls_insecure) == (
        "u", "pw", "t", "/c.creds", "/ca.pem", True)

    uri = Connection(conn_id="y", uri="nats://u:pw@127.0.0.1:4222")
    assert settings_from_connection(uri).servers == ("nats://127.0.0.1:4222",)

    listed = Connection(conn_id="z", conn_type="nats", extra=json.dumps({"servers": ["tls://a:1", "b:2"]}))
    assert settings_from_connection(listed).servers == ("tls://a:1", "nats://b:2")

    with pytest.raises(ValueError, match="names no NATS server"):
        settings_from_connection(Connection(conn_id="empty", conn_type="nats"))
