"""The dead-letter stream's settings are its own: ``bufferConfig.deadLetter`` with documented
defaults, never ``bufferConfig.stream`` (real nats-server)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from isbflow.isb import provision
from isbflow.isb.connect import connect
from isbflow.isb.dlq import publish_dead_letters
from isbflow.isb.provision import Action, ChangeClass, ProvisionRefused
from isbflow.spec import SpecError, load_specs
from tests.conftest import ROOT
from tests.helpers.provision import apply, infos

DLQ = "isb-logs-dlq"
ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")
#: the seed's buffers: a 30,000-message memory WorkQueue (dead letters used to sit in one too)
SEED = {"retention": "WorkQueue", "storage": "memory", "maxMsgs": 30000, "maxBytes": "16MiB"}


def write(tmp_path: Path, name: str = "spec.yaml", dead_letter: dict | None = None, **stream) -> Path:
    docs = list(yaml.safe_load_all((ROOT / "pipelines" / "logs.yaml").read_text()))
    buffers = docs[0]["spec"]["jetstream"]["bufferConfig"]
    buffers["stream"].update({"maxBytes": "64MiB", **stream})
    if dead_letter is not None:
        buffers["deadLetter"] = dead_letter
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def dlq_config(settings, specs):
    return infos(settings, specs)[DLQ].config


def test_defaults_are_not_the_buffers_settings(nats_server, tmp_path):
    specs = load_specs(write(tmp_path, **SEED))
    by = {r.name: r for r in provision.desired_resources(specs)}
    assert by["isb-logs-in-parse-0"].fields["storage"].value == "memory"
    apply(nats_server.settings, specs)
    edge = infos(nats_server.settings, specs)["isb-logs-in-parse-0"].config
    assert (edge.storage, edge.retention, edge.max_msgs) == ("memory", "workqueue", 30000)
    dl = dlq_config(nats_server.settings, specs)
    assert (dl.storage, dl.retention, dl.discard) == ("file", "limits", "new")
    assert (dl.max_msgs, dl.max_bytes, dl.max_age) == (100_000, 256 * 1024**2, 7 * 24 * 3600.0)
    assert (dl.num_replicas, dl.duplicate_window, dl.subjects) == (1, 120.0, ["isb.logs.dlq.>"])
    assert dl.metadata["isbflow.role"] == "dlq"


def test_an_override_is_applied_and_shown_by_diff(nats_server, tmp_path):
    s = nats_server.settings
    apply(s, load_specs(write(tmp_path)))
    changed = load_specs(write(tmp_path, "changed.yaml", {"maxMsgs": 5000, "maxAge": "24h", "duplicates": "30s"}))
    drift = asyncio.run(provision.diff(s, changed))
    assert {d.resource for d in drift} == {DLQ}  # the buffers are as they were
    assert {(d.field, d.spec, d.server, d.cls) for d in drift} == {
        ("max_msgs", 5000, 100_000, ChangeClass.SAFE), ("max_age", 86400.0, 604800.0, ChangeClass.SAFE),
        ("duplicate_window", 30.0, 120.0, ChangeClass.SAFE)}
    report = apply(s, changed)
    assert {r.name: r.action for r in report.resources if r.action != Action.UNCHANGED} == {DLQ: Action.UPDATED}
    dl = dlq_config(s, changed)
    assert (dl.max_msgs, dl.max_age, dl.duplicate_window, dl.storage) == (5000, 86400.0, 30.0, "file")
    assert asyncio.run(provision.diff(s, changed)) == []

    memory = load_specs(write(tmp_path, "memory.yaml", {"storage": "memory", "maxBytes": "8MiB"}))
    [storage] = [d for d in asyncio.run(provision.diff(s, memory)) if d.field == "storage"]
    assert (storage.resource, storage.cls) == (DLQ, ChangeClass.RECREATE)
    with pytest.raises(ProvisionRefused, match=f"{DLQ}: storage file -> memory: needs a recreate"):
        apply(s, memory)
    assert actions_of(apply(s, memory, recreate=True))[DLQ] == Action.RECREATED
    assert dlq_config(s, memory).storage == "memory"


def actions_of(report) -> dict[str, Action]:
    return {r.name: r.action for r in report.resources}


def test_a_full_dead_letter_stream_refuses_a_letter_rather_than_dropping_one(nats_server, tmp_path):
    s = nats_server.settings
    specs = load_specs(write(tmp_path, dead_letter={"maxMsgs": 3}))
    apply(s, specs)
    assert dlq_config(s, specs).discard == "new"

    async def letters(n: int, start: int) -> int:
        nc = await connect(s)
        try:
            return await publish_dead_letters(nc.jetstream(), "logs", "parse",
                                              [{"n": i} for i in range(start, start + n)], reason="test")
        finally:
            await nc.close()

    assert asyncio.run(letters(3, 0)) == 3
    with pytest.raises(Exception, match="maximum messages exceeded"):
        asyncio.run(letters(1, 3))
    info = infos(s, specs)[DLQ]
    assert (info.state.messages, info.state.first_seq) == (3, 1)  # the first three are still there


def test_the_cli_shows_the_dead_letter_stream(nats_server, tmp_path):
    url = ["--nats-url", nats_server.url]
    apply(nats_server.settings, load_specs(write(tmp_path)))
    changed = str(write(tmp_path, "changed.yaml", {"maxMsgs": 2000}))

    def isb(*args):
        return subprocess.run([ISBFLOW, "isb", *args], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL, cwd=ROOT)

    diff = isb("diff", "-f", changed, *url, "--json")
    assert diff.returncode == 3
    assert [(d["resource"], d["field"], d["spec"], d["server"]) for d in json.loads(diff.stdout)["drift"]] == [
        (DLQ, "max_msgs", 2000, 100_000)]
    assert isb("apply", "-f", changed, *url).returncode == 0
    status = isb("status", "-f", changed, *url, "--json")
    config = next(r for r in json.loads(status.stdout)["resources"] if r["name"] == DLQ)["config"]
    assert {k: config[k] for k in ("storage", "retention", "discard", "max_msgs", "max_age")} == {
        "storage": "file", "retention": "limits", "discard": "new", "max_msgs": 2000, "max_age": 604800.0}


# ------------------------------------------------------------------ the spec


def problems(path: Path) -> list:
    with pytest.raises(SpecError) as e:
        load_specs(path)
    return e.value.problems


def test_dead_letter_fields_are_checked_like_the_buffers(tmp_path):
    [p] = problems(write(tmp_path, "a.yaml", {"maxMsg": 10}))
    assert p.path == "jetstream.bufferConfig.deadLetter.maxMsg" and "did you mean 'maxMsgs'" in p.message
    [p] = problems(write(tmp_path, "b.yaml", {"maxAge": ".inf"}))
    assert p.path == "jetstream.bufferConfig.deadLetter.maxAge"
    docs = list(yaml.safe_load_all(write(tmp_path, "c.yaml", {"replicas": 3}).read_text()))
    docs[0]["spec"]["jetstream"]["replicas"] = 1
    (tmp_path / "c.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
    [p] = problems(tmp_path / "c.yaml")
    assert "bufferConfig.deadLetter.replicas is 3 but replicas (JetStream servers) is 1" in p.message


def test_numaflow_string_form_and_codes(tmp_path):
    docs = list(yaml.safe_load_all((ROOT / "pipelines" / "logs.yaml").read_text()))
    docs[0]["spec"]["jetstream"]["bufferConfig"] = (
        "stream:\n  retention: 2\n  maxBytes: 64MiB\ndeadLetter:\n  retention: 0\n  storage: 0\n  maxAge: 72h\n")
    f = tmp_path / "numaflow.yaml"
    f.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    jet = load_specs(f).services["default"].spec.jetstream
    dl = jet.bufferConfig.deadLetter
    assert (dl.retention.value, dl.storage.value, dl.maxAge, dl.maxMsgs) == ("Limits", "file", 72 * 3600.0, 100_000)
    assert jet.bufferConfig.stream.retention.value == "WorkQueue"
