"""isbflow.isb.provision against a real nats-server (single node and a 3-node cluster)."""

from __future__ import annotations

import asyncio
import time

import pytest

from isbflow.isb import naming, provision
from isbflow.isb.connect import connect
from isbflow.isb.provision import Action, ProvisionError
from isbflow.spec import SpecError, load_specs
from tests.helpers.provision import (  # noqa: F401
    SMALL,
    actions,
    apply,
    infos,
    publish,
    spec,
    stream_names,
    write_spec,
)


def test_desired_resources_cover_the_pipeline(tmp_path):
    specs = spec(tmp_path)
    p = specs.only_pipeline()
    res = provision.desired_resources(specs)
    names = [r.name for r in res]
    edges = [ep.stream for ep in naming.edge_partitions(p)]
    assert names == (["src-logs-in"] + edges + ["isb-logs-dlq", "isbflow-logs-control",
                                                   "isbflow-logs-status", "isbflow-logs-ledger"])
    assert len(edges) == 2 + 2 + 1 + 1 + 1 + 1  # in->parse and parse->enrich have 2 partitions
    by = {r.name: r for r in res}
    assert by["src-logs-in"].fields["subjects"] == ["logs.events"]
    assert by["isb-logs-dlq"].fields["subjects"] == ["isb.logs.dlq.>"]
    assert by["isb-logs-in-parse-1"].labels["isbflow.partition"] == "1"
    assert by["isbflow-logs-control"].stream == "KV_isbflow-logs-control"


def test_discard_policy_follows_retention_and_limits(tmp_path):
    def discard(**stream):
        return provision.desired_resources(spec(tmp_path, **stream))[1].fields["discard"].value

    assert discard(retention="Limits", maxMsgs=1000) == "old"
    assert discard(retention="WorkQueue", maxMsgs=1000) == "new"
    assert discard(retention="Interest", maxMsgs=-1, maxBytes=-1) == "old"
    assert discard(retention="Interest", maxMsgs=-1, maxBytes="1MiB") == "new"


def test_unknown_pipeline_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="no Pipeline named 'nope'"):
        provision.desired_resources(spec(tmp_path), "nope")


# ------------------------------------------------------------------ single server


def test_apply_creates_everything_configured_from_the_spec(nats_server, tmp_path):
    specs = spec(tmp_path, maxMsgs=5000, maxAge="1h", duplicates="30s")
    report = apply(nats_server.settings, specs)
    assert report.changed
    assert set(actions(report).values()) == {Action.CREATED}
    assert len(report.resources) == 13
    found = infos(nats_server.settings, specs)
    assert all(found.values()), [n for n, i in found.items() if i is None]
    edge = found["isb-logs-parse-enrich-1"].config
    assert edge.subjects == ["isb.logs.parse.enrich.1"]
    assert (edge.retention, edge.storage, edge.discard) == ("limits", "file", "old")
    assert (edge.max_msgs, edge.max_bytes, edge.max_age) == (5000, 64 * 1024**2, 3600.0)
    assert edge.duplicate_window == 30.0
    assert edge.max_msg_size == 8 * 1024**2
    assert edge.allow_direct is True
    meta = edge.metadata
    assert meta["isbflow.pipeline"] == "logs"
    assert meta["isbflow.edge"] == "parse->enrich"
    assert meta["isbflow.partition"] == "1"
    assert len(meta["isbflow.spec-hash"]) == 16
    kv = found["KV_isbflow-logs-control"].config
    assert kv.max_msgs_per_subject == provision.KV_HISTORY["control"]
    assert kv.metadata["isbflow.role"] == "control"
    assert asyncio.run(provision.diff(nats_server.settings, specs)) == []


def test_second_apply_changes_nothing(nats_server, tmp_path):
    specs = spec(tmp_path)
    apply(nats_server.settings, specs)
    again = apply(nats_server.settings, specs)
    assert not again.changed
    assert set(actions(again).values()) == {Action.UNCHANGED}
    assert again.to_json()["changed"] is False


def test_changed_limits_are_updated_in_place(nats_server, tmp_path):
    apply(nats_server.settings, spec(tmp_path))
    publish(nats_server.settings, "isb.logs.in.parse.0", 3)
    changed = spec(tmp_path, maxMsgs=777, replicas=1, duplicates="1m")
    drift = asyncio.run(provision.diff(nats_server.settings, changed))
    assert {(d.field, d.spec, d.server) for d in drift if d.resource == "isb-logs-in-parse-0"} == {
        ("max_msgs", 777, -1), ("duplicate_window", 60.0, 120.0)}
    report = apply(nats_server.settings, changed)
    assert report.changed
    entry = next(r for r in report.resources if r.name == "isb-logs-in-parse-0")
    assert entry.action == Action.UPDATED
    assert {(c.field, c.old, c.new) for c in entry.changes} == {("max_msgs", -1, 777),
                                                                 ("duplicate_window", 120.0, 60.0)}
    server = infos(nats_server.settings, changed)["isb-logs-in-parse-0"]
    assert server.config.max_msgs == 777
    assert server.state.messages == 3  # the update kept the data
    assert asyncio.run(provision.diff(nats_server.settings, changed)) == []
    assert not apply(nats_server.settings, changed).changed


def test_storage_change_is_refused_and_nothing_is_applied(nats_server, tmp_path):
    """All or nothing: a storage change without --recreate refuses the run, so the max_msgs
    change (safe on its own) is not applied either."""
    apply(nats_server.settings, spec(tmp_path))
    changed = spec(tmp_path, storage="memory", maxMsgs=10)
    with pytest.raises(provision.ProvisionRefused) as err:
        apply(nats_server.settings, changed)
    report = err.value.report
    assert not report.changed and report.refused
    buf = "isb-logs-in-parse-0"
    entry = next(r for r in report.resources if r.name == buf)
    assert entry.action == Action.REFUSED and "--recreate" in entry.message
    by_field = {c.field: c for c in entry.changes}
    assert by_field["storage"].cls == provision.ChangeClass.RECREATE and not by_field["storage"].applied
    assert by_field["max_msgs"].cls == provision.ChangeClass.SAFE and not by_field["max_msgs"].applied
    kv = next(r for r in report.resources if r.name == "isbflow-logs-control")
    assert kv.action == Action.UNCHANGED  # KV storage follows persistence, not bufferConfig
    dlq = next(r for r in report.resources if r.name == "isb-logs-dlq")
    assert dlq.action == Action.UNCHANGED  # dead letters: bufferConfig.deadLetter, not bufferConfig.stream
    server = infos(nats_server.settings, changed)[buf].config
    assert (server.storage, server.max_msgs) == ("file", -1)
    assert f"{buf}: storage file -> memory: needs a recreate, 0 unread" in str(err.value)
    drift = asyncio.run(provision.diff(nats_server.settings, changed))
    assert (buf, "storage", "memory", "file", "recreate") in {
        (d.resource, d.field, d.to_json()["spec"], d.to_json()["server"], d.to_json()["class"]) for d in drift}
    assert not [d for d in drift if d.resource == "isb-logs-dlq"]


def test_recreate_is_refused_for_a_stream_with_messages_unless_forced(nats_server, tmp_path):
    apply(nats_server.settings, spec(tmp_path))
    publish(nats_server.settings, "isb.logs.enrich.raw.0", 5)
    changed = spec(tmp_path, storage="memory")
    with pytest.raises(provision.ProvisionRefused) as err:
        apply(nats_server.settings, changed, recreate=True)
    acts = actions(err.value.report)
    assert acts["isb-logs-enrich-raw-0"] == Action.REFUSED
    assert acts["isb-logs-enrich-minutely-0"] == Action.SKIPPED  # empty, but the run was refused
    refused = next(r for r in err.value.report.resources if r.action == Action.REFUSED)
    assert "5 message(s)" in refused.message and refused.unread == 5
    found = infos(nats_server.settings, changed)
    assert (found["isb-logs-enrich-raw-0"].config.storage, found["isb-logs-enrich-raw-0"].state.messages) == (
        "file", 5)
    assert found["isb-logs-enrich-minutely-0"].config.storage == "file"

    forced = apply(nats_server.settings, changed, recreate=True, force=True)
    assert actions(forced)["isb-logs-enrich-raw-0"] == Action.RECREATED
    assert actions(forced)["isb-logs-enrich-minutely-0"] == Action.RECREATED
    raw = infos(nats_server.settings, changed)["isb-logs-enrich-raw-0"]
    assert (raw.config.storage, raw.state.messages) == ("memory", 0)
    assert asyncio.run(provision.diff(nats_server.settings, changed)) == []


def test_status_counts_what_was_published(nats_server, tmp_path):
    specs = spec(tmp_path)
    before = asyncio.run(provision.status(nats_server.settings, specs))
    assert not any(s.exists for s in before)
    apply(nats_server.settings, specs)
    publish(nats_server.settings, "isb.logs.parse.enrich.1", 7)
    publish(nats_server.settings, "logs.events", 2)

    async def put():
        nc = await connect(nats_server.settings)
        try:
            kv = await nc.jetstream().key_value("isbflow-logs-control")
            await kv.put("parse", b"running")
        finally:
            await nc.close()

    asyncio.run(put())
    by = {s.name: s for s in asyncio.run(provision.status(nats_server.settings, specs))}
    s = by["isb-logs-parse-enrich-1"]
    assert (s.messages, s.first_seq, s.last_seq, s.replicas) == (7, 1, 7, 1)
    assert s.bytes > 0 and s.leader
    assert by["src-logs-in"].messages == 2
    assert by["isb-logs-parse-enrich-0"].messages == 0
    assert by["isbflow-logs-control"].values == 1 and by["isbflow-logs-status"].values == 0
    assert by["isb-logs-dlq"].to_json()["values"] is None


def test_delete_removes_everything(nats_server, tmp_path):
    specs = spec(tmp_path)
    apply(nats_server.settings, specs)
    deleted = asyncio.run(provision.delete(nats_server.settings, specs))
    assert deleted == [r.name for r in provision.desired_resources(specs)]
    assert not any(infos(nats_server.settings, specs).values())
    assert asyncio.run(provision.delete(nats_server.settings, specs)) == []


def test_replicas_above_the_cluster_size_is_a_clear_error(nats_server, tmp_path):
    with pytest.raises(ProvisionError) as err:
        apply(nats_server.settings, spec(tmp_path, replicas=3))
    msg = str(err.value)
    assert "src-logs-in" in msg and "replicas is 3" in msg and "--cluster 3" in msg
    assert err.value.report is not None and err.value.report.resources == []


# ------------------------------------------------------------------ 3-node cluster


def test_cluster_gets_r3_streams_with_current_replicas(nats_cluster, tmp_path):
    specs = spec(tmp_path, replicas=3)
    report = apply(nats_cluster.settings, specs)
    assert set(actions(report).values()) == {Action.CREATED}
    deadline = time.monotonic() + 20
    while True:
        statuses = asyncio.run(provision.status(nats_cluster.settings, specs))
        healthy = [s for s in statuses if sum(1 for p in s.peers if p.current and not p.offline) == 2]
        if len(healthy) == len(statuses) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for s in statuses:
        assert s.replicas == 3 and s.leader, s
        assert len(s.peers) == 2 and all(p.current and not p.offline for p in s.peers), s
        assert s.leader not in {p.name for p in s.peers}
    assert not apply(nats_cluster.settings, specs).changed


def test_a_source_stream_named_in_the_spec_is_created_but_never_changed(nats_server, tmp_path):
    specs = load_specs(write_spec(tmp_path, source_stream="events"))
    assert actions(apply(nats_server.settings, specs))["events"] == Action.CREATED

    async def producers_change_it():
        nc = await connect(nats_server.settings)
        try:
            js = nc.jetstream()
            config = (await js.stream_info("events")).config
            await js.update_stream(config.evolve(subjects=["logs.events", "audit.>"], max_msgs=50))
        finally:
            await nc.close()

    asyncio.run(producers_change_it())
    report = apply(nats_server.settings, specs)
    assert actions(report)["events"] == Action.UNCHANGED and not report.changed
    events = infos(nats_server.settings, specs)["events"].config
    assert (events.subjects, events.max_msgs) == (["logs.events", "audit.>"], 50)
    assert not [d for d in asyncio.run(provision.diff(nats_server.settings, specs)) if d.resource == "events"]
    assert "events" not in asyncio.run(provision.delete(nats_server.settings, specs))
    assert infos(nats_server.settings, specs)["events"] is not None


def test_interest_buffers_keep_messages_until_released(nats_server, tmp_path):
    """Interest retention stores nothing without a consumer: apply adds the hold consumer,
    so published frames stay readable until release() purges them after the commit."""
    from isbflow.isb.release import release

    specs = spec(tmp_path, retention="Interest")
    apply(nats_server.settings, specs)
    ep = naming.edge_partitions(specs.only_pipeline())[0]
    publish(nats_server.settings, ep.subject, 5)
    assert infos(nats_server.settings, specs)[ep.stream].state.messages == 5
    assert apply(nats_server.settings, specs).changed is False  # hold consumer re-ensured, no change
    purged = asyncio.run(release(nats_server.settings, ep.stream, 3, "Interest"))
    assert purged == 3
    assert infos(nats_server.settings, specs)[ep.stream].state.messages == 2
