"""Every stream names its owner in its metadata, and provisioning never updates, recreates or
deletes a stream whose metadata names another owner (real nats-server).

Two specs that derive the same stream name are refused when validated together
(tests/spec/test_derived.py); these are the specs that were never loaded together.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from nats.js.api import StreamConfig

from isbflow.isb import provision
from isbflow.isb.connect import connect
from isbflow.isb.owners import OwnershipRefused
from isbflow.isb.provision import Action, ChangeClass, ProvisionRefused
from isbflow.isb.roles import pipeline_grants
from isbflow.isb.server import grant_pipelines, read_grants, role_password_file
from isbflow.ops import isb as ops_isb
from isbflow.spec import load_specs
from tests.conftest import ROOT
from tests.helpers.provision import apply, publish, write_spec

ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")
SHARED = "isb-p-a-b-c-0"  # edge a -> b-c of pipeline p, edge a-b -> c of pipeline p, edge b -> c of pipeline p-a


def write(tmp_path: Path, file: str, name: str, chain: list[str]) -> Path:
    """Pipeline ``name``: source chain[0] -> udfs ... -> sink chain[-1], on a small ISB service."""
    vertices = ([{"name": chain[0], "source": {"jetstream": {"subject": f"{file}.events"}}}]
                + [{"name": v, "udf": {"transform": "spark_apps.logs:parse"}} for v in chain[1:-1]]
                + [{"name": chain[-1], "sink": {"delta": {"path": f"sinks/{file}"}}}])
    edges = [{"from": a, "to": b} for a, b in zip(chain, chain[1:], strict=False)]
    docs = [{"kind": "InterStepBufferService", "metadata": {"name": "default"},
             "spec": {"jetstream": {"bufferConfig": {"stream": {"maxBytes": "16MiB"}}}}},
            {"kind": "Pipeline", "metadata": {"name": name},
             "spec": {"vertices": vertices, "edges": edges}}]
    path = tmp_path / f"{file}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


async def _stream(settings, name: str):
    nc = await connect(settings)
    try:
        return await nc.jetstream().stream_info(name)
    finally:
        await nc.close()


def stream(settings, name: str):
    return asyncio.run(_stream(settings, name))


def names_on_server(settings) -> set[str]:
    async def go():
        nc = await connect(settings)
        try:
            return {s.config.name for s in await nc.jetstream().streams_info()}
        finally:
            await nc.close()

    return asyncio.run(go())


def test_a_stream_of_another_edge_is_never_updated_recreated_or_deleted(nats_server, tmp_path):
    settings = nats_server.settings
    first = load_specs(write(tmp_path, "first", "p", ["in", "a", "b-c", "out"]))
    second_file = write(tmp_path, "second", "p", ["in", "a-b", "c", "out"])
    second = load_specs(second_file)
    apply(settings, first)
    meta = stream(settings, SHARED).config.metadata
    assert (meta["isbflow.pipeline"], meta["isbflow.edge"], meta["isbflow.partition"]) == ("p", "a->b-c", "0")
    publish(settings, "isb.p.a.b-c.0", 3)
    before = names_on_server(settings)

    for flags in ({}, {"recreate": True, "force": True}):
        with pytest.raises(ProvisionRefused) as err:
            apply(settings, second, **flags)
        assert not err.value.report.changed
        entry = next(r for r in err.value.report.resources if r.name == SHARED)
        assert entry.action == Action.REFUSED and "another owner" in entry.message
        assert [(c.field, c.cls) for c in entry.changes] == [("owner", ChangeClass.FOREIGN)]
        assert (f"{SHARED}: owned by pipeline p, buffer a->b-c partition 0, not by pipeline p, buffer a-b->c "
                "partition 0: owned by another pipeline or edge, 3 message(s)") in str(err.value)
    info = stream(settings, SHARED)
    assert (info.config.subjects, info.state.messages) == (["isb.p.a.b-c.0"], 3)  # as the first spec made it
    assert info.config.metadata["isbflow.edge"] == "a->b-c"
    assert names_on_server(settings) == before  # the refused runs created nothing either

    drift = [d for d in asyncio.run(provision.diff(settings, second)) if d.resource == SHARED]
    assert [(d.field, d.spec, d.server, d.cls) for d in drift] == [
        ("owner", "pipeline p, buffer a-b->c partition 0", "pipeline p, buffer a->b-c partition 0",
         ChangeClass.FOREIGN)]

    with pytest.raises(ProvisionRefused, match="nothing was deleted") as err:
        asyncio.run(provision.delete(settings, second))
    assert f"{SHARED}: owned by pipeline p, buffer a->b-c partition 0" in str(err.value)
    assert names_on_server(settings) == before
    assert stream(settings, SHARED).state.messages == 3

    # the owner itself still manages it
    assert SHARED in asyncio.run(provision.delete(settings, first))


def test_a_stream_of_another_pipeline_is_refused_from_the_cli(nats_server, tmp_path):
    url = ["--nats-url", nats_server.url]
    first = write(tmp_path, "first", "p", ["in", "a-b", "c", "out"])
    second = write(tmp_path, "second", "p-a", ["src", "b", "c", "out"])
    apply(nats_server.settings, load_specs(first))

    def isb(*args):
        return subprocess.run([ISBFLOW, "isb", *args], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL, cwd=ROOT)

    refused = isb("apply", "-f", str(second), *url)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"{SHARED}: owned by pipeline p, buffer a-b->c partition 0, not by pipeline p-a, buffer b->c" \
        in refused.stderr
    assert "refused, nothing was applied" in refused.stderr
    diff = isb("diff", "-f", str(second), *url, "--json")
    assert diff.returncode == 3
    owner = [d for d in json.loads(diff.stdout)["drift"] if d["field"] == "owner"]
    assert owner == [{"resource": SHARED, "kind": "stream", "field": "owner", "spec": "pipeline p-a, buffer b->c "
                      "partition 0", "server": "pipeline p, buffer a-b->c partition 0", "class": "foreign",
                      "unread": 0, "reason": owner[0]["reason"]}]
    table = isb("diff", "-f", str(second), *url)
    assert "foreign: owned by another pipeline or edge" in table.stdout
    deleted = isb("delete", "-f", str(second), *url, "--yes")
    assert deleted.returncode == 1 and "nothing was deleted" in deleted.stderr
    assert stream(nats_server.settings, SHARED).config.metadata["isbflow.pipeline"] == "p"


def test_a_stream_without_owner_metadata_is_adopted(nats_server, tmp_path):
    """A stream an older isbflow created carries no owner: apply adopts it, messages kept."""
    settings = nats_server.settings
    specs = load_specs(write(tmp_path, "old", "p", ["in", "a", "b-c", "out"]))
    r = next(r for r in provision.desired_resources(specs) if r.name == SHARED)

    async def older_isbflow():
        nc = await connect(settings)
        try:
            await nc.jetstream().add_stream(StreamConfig(name=SHARED, **r.fields))
        finally:
            await nc.close()

    asyncio.run(older_isbflow())
    publish(settings, "isb.p.a.b-c.0", 2)
    report = apply(settings, specs)
    entry = next(x for x in report.resources if x.name == SHARED)
    assert entry.action == Action.UPDATED and [c.field for c in entry.changes] == ["metadata"]
    info = stream(settings, SHARED)
    assert info.state.messages == 2
    assert (info.config.metadata["isbflow.pipeline"], info.config.metadata["isbflow.edge"]) == ("p", "a->b-c")
    assert not apply(settings, specs).changed


# ------------------------------------------------------------------ one pipeline cannot claim another's


def logs_and(tmp_path: Path, nats_server, name: str, source: dict) -> Path:
    """pipelines/logs.yaml provisioned and granted; returns the spec of pipeline ``name``, a copy of
    logs whose source is ``source``."""
    apply(nats_server.settings, load_specs(write_spec(tmp_path, "logs.yaml")))
    assert grant_pipelines(nats_server.data_dir, [pipeline_grants(load_specs(tmp_path / "logs.yaml").only_pipeline())])
    docs = list(yaml.safe_load_all((tmp_path / "logs.yaml").read_text()))
    p = next(d for d in docs if d["kind"] == "Pipeline")
    p["metadata"]["name"] = name
    p["spec"]["vertices"][0]["source"]["jetstream"] = source
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def test_isb_apply_of_a_spec_naming_another_pipelines_buffer_is_refused(nats_server, tmp_path):
    """The spec would hand its user read, consumer-create and purge on logs' buffer: refused at
    validate, nothing provisioned or granted."""
    steal = logs_and(tmp_path, nats_server, "steal", {"subject": "steal.events", "stream": "isb-logs-in-parse-0"})
    r = subprocess.run([ISBFLOW, "isb", "apply", "-f", str(steal), "--nats-url", nats_server.url,
                        "--data-dir", str(nats_server.data_dir)], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{steal}: vertices[0].source.jetstream.stream: 'isb-logs-in-parse-0' is inside isbflow's own " \
           "namespace" in r.stderr
    assert "steal" not in {g.pipeline for g in read_grants(nats_server.data_dir)}
    assert not role_password_file(nats_server.data_dir, "pipeline-steal").exists()


def test_apply_of_a_source_subject_another_pipeline_owns_is_refused_naming_the_owner(nats_server, tmp_path):
    steal = load_specs(logs_and(tmp_path, nats_server, "steal", {"subject": "logs.events", "stream": "steal-in"}))
    before = names_on_server(nats_server.settings)
    with pytest.raises(ProvisionRefused) as err:  # the embedded server's grants name the owner
        ops_isb.apply(nats_server.settings, steal, data_dir=nats_server.data_dir)
    assert "subject 'logs.events' (source subject of pipeline steal) is owned by pipeline logs (source subject)" \
        in str(err.value)
    with pytest.raises(ProvisionRefused) as err:  # and so does the stream's metadata, on any server
        apply(nats_server.settings, steal)
    assert ("subject 'logs.events' (subject of source in of pipeline steal) is owned by pipeline logs "
            "(subject of its source stream src-logs-in)") in str(err.value)
    assert names_on_server(nats_server.settings) == before
    assert "steal" not in {g.pipeline for g in read_grants(nats_server.data_dir)}


def test_grant_pipelines_refuses_what_another_pipeline_was_granted(nats_server, tmp_path):
    """Grants compared across pipelines, whatever the streams on the server: a grant holding
    another pipeline's buffer (a spec that was never validated with the owner's, or a hand-made
    grant) gives nothing."""
    logs_and(tmp_path, nats_server, "steal", {"subject": "steal.events"})
    auth = (nats_server.data_dir / "nats" / "auth.conf").read_text()
    stolen = replace(pipeline_grants(load_specs(tmp_path / "steal.yaml").only_pipeline()),
                     sources=("isb-logs-in-parse-0",), source_subjects=("isb.logs.in.parse.0",))
    with pytest.raises(OwnershipRefused) as err:
        grant_pipelines(nats_server.data_dir, [stolen])
    assert "stream 'isb-logs-in-parse-0' (source stream of pipeline steal) is owned by pipeline logs (buffer)" \
        in str(err.value)
    assert (nats_server.data_dir / "nats" / "auth.conf").read_text() == auth
    assert [g.pipeline for g in read_grants(nats_server.data_dir)] == ["logs"]
    # derived names that meet (pipeline p's edge a-b -> c and pipeline p-a's edge b -> c), loaded apart
    first = load_specs(write(tmp_path, "first", "p", ["in", "a-b", "c", "out"])).only_pipeline()
    second = load_specs(write(tmp_path, "second", "p-a", ["src", "b", "c", "out"])).only_pipeline()
    assert grant_pipelines(nats_server.data_dir, [pipeline_grants(first)])
    with pytest.raises(OwnershipRefused, match=f"stream '{SHARED}' \\(buffer of pipeline p-a\\) is owned by "
                                               "pipeline p \\(buffer\\)"):
        grant_pipelines(nats_server.data_dir, [pipeline_grants(second)])
    assert grant_pipelines(nats_server.data_dir, [pipeline_grants(first)])  # its owner is granted again


def test_the_provision_operator_refuses_a_spec_naming_another_pipelines_buffer(nats_server, tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from isbflow.airflow.operators.isb import IsbProvisionOperator

    steal = logs_and(tmp_path, nats_server, "steal", {"subject": "steal.events", "stream": "isb-logs-in-parse-0"})
    monkeypatch.delenv("AIRFLOW_CONN_NATS_DEFAULT", raising=False)
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.setenv("ISBFLOW_HOME", str(nats_server.data_dir))
    monkeypatch.chdir(nats_server.data_dir)
    op = IsbProvisionOperator(task_id="provision", pipeline_file=steal.name, pipelines_dir=str(tmp_path))
    with pytest.raises(AirflowFailException, match="'isb-logs-in-parse-0' is inside isbflow's own namespace"):
        op.execute({})
    assert "steal" not in {g.pipeline for g in read_grants(nats_server.data_dir)}
