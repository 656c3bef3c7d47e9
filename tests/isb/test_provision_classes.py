"""Provisioning never drops unread data without --force: every change is classified before
anything is applied, and a refused run leaves every buffer as it was (real nats-server)."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import StreamConfig

from isbflow.isb import provision
from isbflow.isb.connect import connect
from isbflow.isb.provision import Action, ChangeClass, ProvisionRefused
from isbflow.isb.provision_plan import Holding, compare
from isbflow.isb.state import put_committed
from tests.helpers.provision import apply, infos, publish, spec

BUF, SUBJECT = "isb-logs-in-parse-0", "isb.logs.in.parse.0"
SAFE, DISCARD, RECREATE = ChangeClass.SAFE, ChangeClass.MAY_DISCARD, ChangeClass.RECREATE


def buffer(settings, specs):
    return infos(settings, specs)[BUF]


def refused_run(settings, specs, **kw) -> ProvisionRefused:
    with pytest.raises(ProvisionRefused) as err:
        apply(settings, specs, **kw)
    assert not err.value.report.changed
    return err.value


def classes(tmp_path, holding: Holding, have: dict, **stream) -> dict[str, ChangeClass]:
    """The class of each change of the in->parse buffer from ``have`` to the spec's ``stream`` fields."""
    r = next(r for r in provision.desired_resources(spec(tmp_path, **stream)) if r.name == BUF)
    config = StreamConfig(**{**r.fields, **have})
    changes, _ = compare(r, config, holding)
    return {c.field: c.cls for c in changes}


# ------------------------------------------------------------------ pure: the rules


def test_classes_follow_what_the_stream_holds(tmp_path):
    held = Holding(messages=100, bytes=10_000, unread=100, oldest_unread_age=600.0)
    # Limits (discard old): a limit below the unread messages drops them at once
    assert classes(tmp_path, held, {"max_msgs": -1}, maxMsgs=10) == {"max_msgs": DISCARD}
    assert classes(tmp_path, held, {"max_msgs": -1}, maxMsgs=100) == {"max_msgs": SAFE}
    assert classes(tmp_path, held, {"max_msgs": 50}, maxMsgs=500) == {"max_msgs": SAFE}  # raised
    assert classes(tmp_path, Holding(100, 10_000, 5), {"max_msgs": -1}, maxMsgs=10) == {"max_msgs": SAFE}
    assert classes(tmp_path, held, {"max_bytes": -1}, maxBytes=5000) == {"max_bytes": DISCARD}
    assert classes(tmp_path, held, {"max_age": 0.0}, maxAge="5m", duplicates="1m") == {"max_age": DISCARD}
    assert classes(tmp_path, held, {"max_age": 0.0}, maxAge="1h", duplicates="1m") == {"max_age": SAFE}
    # WorkQueue (discard new): a lower limit is back-pressure, nothing is dropped
    assert classes(tmp_path, held, {"max_msgs": -1}, retention="WorkQueue", maxMsgs=10) == {"max_msgs": SAFE}
    # discard new -> old on a bounded buffer holding unread messages; old -> new is safe
    assert classes(tmp_path, held, {"discard": "new"}) == {"discard": DISCARD}
    assert classes(tmp_path, Holding(), {"discard": "new"}) == {"discard": SAFE}
    assert classes(tmp_path, held, {"discard": "old", "retention": "limits"}, retention="WorkQueue") == {"retention": RECREATE,
                                                                                  "discard": SAFE}
    assert classes(tmp_path, held, {"storage": "memory", "num_replicas": 3, "duplicate_window": 60.0}) == {
        "storage": RECREATE, "num_replicas": SAFE, "duplicate_window": SAFE}


# ------------------------------------------------------------------ the two cases of the issue


def test_workqueue_to_limits_is_refused_and_discard_stays_new(nats_server, tmp_path):
    """A WorkQueue buffer with 100 unread; the spec asks Limits and maxMsgs 120: refused, nothing
    applied (discard stays new), and 100 more publishes keep all 200."""
    s = nats_server.settings
    apply(s, spec(tmp_path, retention="WorkQueue"))
    assert buffer(s, spec(tmp_path)).config.discard == "new"
    publish(s, SUBJECT, 100)
    changed = spec(tmp_path, retention="Limits", maxMsgs=120)
    for kw in ({}, {"force": True}, {"recreate": True}):
        err = refused_run(s, changed, **kw)
        entry = next(r for r in err.report.resources if r.name == BUF)
        assert entry.action == Action.REFUSED and entry.unread == 100
        by = {c.field: c.cls for c in entry.changes}
        assert by == {"retention": RECREATE, "max_msgs": SAFE, "discard": DISCARD}
    msg = str(err)
    assert f"{BUF}: retention workqueue -> limits: needs a recreate, 100 unread message(s)" in msg
    assert f"{BUF}: discard new -> old: may discard unread messages, 100 unread message(s)" in msg
    config = buffer(s, changed).config
    assert (config.retention, config.discard, config.max_msgs) == ("workqueue", "new", -1)
    publish(s, SUBJECT, 100)
    assert buffer(s, changed).state.messages == 200


def test_lowering_max_msgs_below_unread_is_refused_without_force(nats_server, tmp_path):
    s = nats_server.settings
    apply(s, spec(tmp_path))
    publish(s, SUBJECT, 100)
    lowered = spec(tmp_path, maxMsgs=10)
    err = refused_run(s, lowered)
    assert f"{BUF}: max_msgs -1 -> 10: may discard unread messages, 100 unread message(s)" in str(err)
    assert "the oldest 90 go at once" in str(err) and "--force" in str(err)
    acts = {r.name: r.action for r in err.report.resources}
    assert acts[BUF] == Action.REFUSED and acts["isb-logs-parse-enrich-0"] == Action.SKIPPED
    for name, info in infos(s, lowered).items():  # nothing at all was applied (dead letters: their own limits)
        if info is not None and not name.startswith("KV_") and name != "isb-logs-dlq":
            assert info.config.max_msgs == -1, name
    assert buffer(s, lowered).state.messages == 100

    forced = apply(s, lowered, force=True)
    entry = next(r for r in forced.resources if r.name == BUF)
    assert entry.action == Action.UPDATED and entry.message.startswith("forced:")
    assert buffer(s, lowered).state.messages == 10
    assert not apply(s, lowered).changed


# ------------------------------------------------------------------ each class against a real server


def test_safe_changes_apply_while_unread_messages_wait(nats_server, tmp_path):
    """Raised limits, a lower limit above the unread count, replicas and duplicates: in place."""
    s = nats_server.settings
    apply(s, spec(tmp_path, maxMsgs=1000))
    publish(s, SUBJECT, 100)
    changed = spec(tmp_path, maxMsgs=500, duplicates="1m", maxAge="48h")
    drift = {d.field: d for d in asyncio.run(provision.diff(s, changed)) if d.resource == BUF}
    assert {f: d.cls for f, d in drift.items()} == {"max_msgs": SAFE, "max_age": SAFE, "duplicate_window": SAFE}
    assert drift["max_msgs"].unread == 100
    report = apply(s, changed)
    assert next(r for r in report.resources if r.name == BUF).action == Action.UPDATED
    info = buffer(s, changed)
    assert (info.config.max_msgs, info.state.messages) == (500, 100)


def test_a_lower_limit_on_a_workqueue_buffer_is_back_pressure(nats_server, tmp_path):
    s = nats_server.settings
    apply(s, spec(tmp_path, retention="WorkQueue"))
    publish(s, SUBJECT, 100)
    lowered = spec(tmp_path, retention="WorkQueue", maxMsgs=10)
    apply(s, lowered)  # safe: discard new keeps what is there
    info = buffer(s, lowered)
    assert (info.config.max_msgs, info.config.discard, info.state.messages) == (10, "new", 100)


def test_committed_messages_of_a_limits_buffer_are_not_unread(nats_server, tmp_path):
    """The reader (parse) committed up to sequence 95: 5 unread, so maxMsgs 10 drops only read ones."""
    s = nats_server.settings
    apply(s, spec(tmp_path))
    publish(s, SUBJECT, 100)

    async def commit():
        nc = await connect(s)
        try:
            await put_committed(nc, "logs", "parse", {BUF: 95})
        finally:
            await nc.close()

    asyncio.run(commit())
    lowered = spec(tmp_path, maxMsgs=10)
    [d] = [d for d in asyncio.run(provision.diff(s, lowered)) if d.resource == BUF]
    assert (d.field, d.cls, d.unread) == ("max_msgs", SAFE, 5)
    apply(s, lowered)
    info = buffer(s, lowered)
    assert (info.state.messages, info.state.last_seq) == (10, 100)


def test_max_age_below_the_oldest_unread_message_may_discard(nats_server, tmp_path):
    s = nats_server.settings
    apply(s, spec(tmp_path))
    publish(s, SUBJECT, 3)
    fresh = spec(tmp_path, maxAge="1h", duplicates="1s")
    [d] = [d for d in asyncio.run(provision.diff(s, fresh)) if d.resource == BUF and d.field == "max_age"]
    assert d.cls == SAFE  # the messages are seconds old
    import time

    time.sleep(2.2)
    short = spec(tmp_path, maxAge="2s", duplicates="1s")
    err = refused_run(s, short)
    assert f"{BUF}: max_age 259200.0 -> 2.0: may discard unread messages, 3 unread" in str(err)
    assert "expires at once" in str(err)
    assert buffer(s, short).state.messages == 3


def test_recreate_class_needs_recreate_and_force_and_leaves_others_alone(nats_server, tmp_path):
    s = nats_server.settings
    apply(s, spec(tmp_path))
    publish(s, SUBJECT, 7)
    changed = spec(tmp_path, storage="memory")
    err = refused_run(s, changed)
    assert f"{BUF}: storage file -> memory: needs a recreate, 7 unread" in str(err)
    assert "re-run with --recreate --force" in str(err)
    err = refused_run(s, changed, recreate=True)
    assert "add --force to drop them" in str(err)
    assert {i.config.storage for n, i in infos(s, changed).items() if not n.startswith("KV_")} == {"file"}
    done = apply(s, changed, recreate=True, force=True)
    entry = next(r for r in done.resources if r.name == BUF)
    assert entry.action == Action.RECREATED and "dropped 7 message(s), 7 unread" in entry.message
    assert (buffer(s, changed).config.storage, buffer(s, changed).state.messages) == ("memory", 0)


def test_a_refused_run_creates_nothing_either(nats_server, tmp_path):
    """A new partition's stream is not created when another change of the run is refused."""
    s = nats_server.settings
    apply(s, spec(tmp_path))
    publish(s, SUBJECT, 50)

    async def drop_bucket():
        nc = await connect(s)
        try:
            await nc.jetstream().delete_key_value("isbflow-logs-ledger")
        finally:
            await nc.close()

    asyncio.run(drop_bucket())
    err = refused_run(s, spec(tmp_path, maxMsgs=5))
    assert {r.name: r.action for r in err.report.resources}["isbflow-logs-ledger"] == Action.SKIPPED
    assert infos(s, spec(tmp_path))["KV_isbflow-logs-ledger"] is None


def test_jetstream_replicas_is_checked_against_the_service_before_anything(nats_server, tmp_path):
    """jetstream.replicas (Numaflow: the JetStream servers) must be available: a single server refuses
    a spec asking for 3, and nothing is created."""
    import yaml

    from isbflow.spec import load_specs
    from tests.helpers.provision import write_spec

    path = write_spec(tmp_path)
    docs = list(yaml.safe_load_all(path.read_text()))
    docs[0]["spec"]["jetstream"]["replicas"] = 3
    path.write_text(yaml.safe_dump_all(docs))
    specs = load_specs(path)
    with pytest.raises(provision.ProvisionError) as err:
        apply(nats_server.settings, specs)
    assert "has 1 JetStream server(s), the spec asks for 3 (jetstream.replicas)" in str(err.value)
    assert "isbflow nats up --cluster 3" in str(err.value)
    assert not any(infos(nats_server.settings, specs).values())


def test_store_limits_of_the_embedded_server_are_checked_not_ignored(nats_server, tmp_path):
    """settings.max_file_store configures the embedded server when isbflow starts it; apply and diff
    against a running one started with other limits say so (apply changes nothing)."""
    import yaml

    from isbflow.spec import load_specs
    from tests.helpers.provision import write_spec

    def with_settings(name: str, **settings) -> object:
        path = write_spec(tmp_path, name)
        docs = list(yaml.safe_load_all(path.read_text()))
        docs[0]["spec"]["jetstream"]["settings"].update(settings)
        path.write_text(yaml.safe_dump_all(docs))
        return load_specs(path)

    s, dd = nats_server.settings, nats_server.data_dir
    bigger = with_settings("big.yaml", max_file_store="20GiB")
    with pytest.raises(provision.ProvisionError) as err:
        apply(s, bigger, data_dir=dd)
    assert f"settings.max_file_store is {20 * 2**30} bytes but the embedded nats-server" in str(err.value)
    assert f"runs with {10 * 2**30}" in str(err.value)
    assert not any(infos(s, bigger).values())
    drift = asyncio.run(provision.diff(s, bigger, data_dir=dd))
    assert (drift[0].resource, drift[0].field, drift[0].cls) == ("nats-server", "settings.max_file_store", RECREATE)
    same = with_settings("same.yaml", max_file_store="10GiB", max_memory_store="1GiB")
    assert apply(s, same, data_dir=dd).changed
    assert asyncio.run(provision.diff(s, same, data_dir=dd)) == []
