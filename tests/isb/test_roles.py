"""Users per role on the embedded server (isbflow.isb.roles): each refused outside its scope.

One real nats-server with two pipelines provisioned and granted (``logs`` and its copy ``other``);
every check connects as a role user with the settings ``resolve_settings(role=...)`` gives, and
asserts that the server itself refuses what the role may not do (a permissions violation, or a
request nobody may answer), and allows what it needs.
"""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
import yaml

from isbflow.isb import naming, roles
from isbflow.isb import state as st
from isbflow.isb.connect import (
    IsbUnreachable,
    connect,
    resolve_settings,
    session,
    settings_from_url,
)
from isbflow.isb.read import stream_state
from isbflow.isb.server import grant_pipelines, read_state, role_password_file
from isbflow.ops.isb import role_settings
from isbflow.spec import load_specs
from isbflow.steps.launch import driver_env
from tests.conftest import ROOT
from tests.helpers.provision import SMALL, apply

WAIT = 30.0


def two_pipelines(tmp_path):
    docs = list(yaml.safe_load_all((ROOT / "pipelines" / "logs.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "InterStepBufferService")
    service["spec"]["jetstream"]["bufferConfig"]["stream"].update(SMALL)
    pipeline = next(d for d in docs if d["kind"] == "Pipeline")
    other = yaml.safe_load(yaml.safe_dump(pipeline))
    other["metadata"]["name"] = "other"
    other["spec"]["vertices"][0]["source"]["jetstream"]["subject"] = "other.events"
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([*docs, other]))
    return load_specs(path)


@pytest.fixture
def granted(nats_server, tmp_path):
    specs = two_pipelines(tmp_path)
    for name in specs.pipelines:
        apply(nats_server.settings, specs, pipeline=name)
    assert grant_pipelines(nats_server.data_dir, [roles.pipeline_grants(p) for p in specs.pipelines.values()])
    return nats_server, specs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT))


async def refused(coro) -> str:
    """``coro`` must fail because the server refused it (a permissions violation makes a request
    time out or answer 'no responders'; the client logs the violation)."""
    try:
        await coro
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError,
            nats.js.errors.ServiceUnavailableError, TimeoutError) as e:
        return type(e).__name__
    raise AssertionError("the server allowed it")


async def refused_all(*coros) -> list[str]:
    """Each of ``coros`` refused (:func:`refused`), all at once: a refusal is often a timeout, and
    their timeouts then run side by side instead of one after another."""
    return list(await asyncio.gather(*(refused(c) for c in coros)))


def violations(server, user: str) -> set[str]:
    """Subjects the server logged a publish or subscription violation for, for ``user``: proof
    that a refusal was the server's permissions, not some other failure."""
    log = Path(server.state.nodes[0].log).read_text()
    return {ln.rsplit('Subject "', 1)[1].split('"', 1)[0] for ln in log.splitlines()
            if f'user:{user}"' in ln and "Violation" in ln}


def as_role(server, role):
    return resolve_settings(data_dir=server.data_dir, role=role)


def test_role_passwords_are_owner_only_files_and_never_in_urls(granted):
    server, _ = granted
    for user in (roles.READER, roles.PRODUCER, roles.pipeline_user("logs"), roles.pipeline_user("other")):
        f = role_password_file(server.data_dir, user)
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        s = as_role(server, user)
        assert s.user == user and s.password == f.read_text().strip()
        assert all("@" not in u for u in s.servers) and s.inbox_prefix == f"_INBOX_{user}"
    assert "password" not in read_state(server.data_dir).to_json(with_secrets=False)["urls"][0]
    with pytest.raises(IsbUnreachable, match="no user 'pipeline-nope'"):
        as_role(server, roles.pipeline_user("nope"))
    # what a launched driver gets (ops.pipeline.start / batch): the pipeline's user on this server ...
    driver = role_settings(server.settings, server.data_dir, roles.pipeline_user("logs"))
    assert driver.user == "pipeline-logs" and driver.password == as_role(server, "pipeline-logs").password
    assert driver_env(driver, server.data_dir)["NATS_USER"] == "pipeline-logs"
    # ... and settings for another server (an external one) unchanged: its operator's users
    elsewhere = settings_from_url("nats://someone:pw@127.0.0.1:1")
    assert role_settings(elsewhere, server.data_dir, roles.pipeline_user("logs")) == elsewhere


def test_producer_publishes_to_its_source_subject_only(granted):
    server, specs = granted
    p = specs.pipelines["logs"]
    src = naming.source_stream(p, "in")
    buffer = naming.edge_partitions(p)[0]

    async def go():
        nc = await connect(as_role(server, roles.PRODUCER))
        try:
            js = nc.jetstream()
            ack = await js.publish("logs.events", b'{"ok": 1}', timeout=5)  # allowed: stored and acked
            assert ack.stream == src
            assert (await js.stream_info(src)).state.messages == 1
            await js.publish("other.events", b"{}", timeout=5)  # the other pipeline's source, also granted
            # refused: reading a buffer, the source stream's messages, writing a control key, an edge subject
            await refused_all(
                nc.request(f"$JS.API.DIRECT.GET.{buffer.stream}", b'{"seq": 1}', timeout=2),
                nc.request(f"$JS.API.STREAM.MSG.GET.{src}", b'{"seq": 1}', timeout=2),
                js.pull_subscribe("logs.events", stream=src),
                js.publish(f"$KV.{naming.control_bucket('logs')}.parse", b"stopped", timeout=2),
                js.publish(buffer.subject, b"forged", timeout=2),
                js.key_value(naming.control_bucket("logs")),
            )
        finally:
            await nc.close()

    run(go())
    assert {f"$JS.API.DIRECT.GET.{buffer.stream}", f"$JS.API.STREAM.MSG.GET.{src}", buffer.subject,
            f"$KV.{naming.control_bucket('logs')}.parse"} <= violations(server, roles.PRODUCER)
    # nothing reached the buffer or the control key
    async def check():
        nc = await connect(server.settings)
        try:
            assert (await stream_state(nc, buffer.stream)).messages == 0
            assert (await st.get_desired(nc, "logs", "parse")).value != "stopped"
        finally:
            await nc.close()

    run(check())


def test_reader_reads_status_and_publishes_nothing(granted):
    server, _ = granted

    async def setup():
        nc = await connect(server.settings)
        try:
            await st.set_desired(nc, "logs", "parse", st.Desired.RUNNING)
        finally:
            await nc.close()

    run(setup())

    async def go():
        nc = await connect(as_role(server, roles.READER))
        try:
            js = nc.jetstream()
            assert (await st.get_desired(nc, "logs", "parse")) == st.Desired.RUNNING  # allowed
            assert (await stream_state(nc, naming.dlq_stream("logs"))).messages == 0
            buffer = naming.edge_partitions(granted[1].pipelines["logs"])[0]
            await refused_all(
                js.publish("logs.events", b"{}", timeout=2),
                js.publish(buffer.subject, b"x", timeout=2),
                st.set_desired(nc, "logs", "parse", st.Desired.STOPPED),
                nc.request(f"$JS.API.DIRECT.GET.{buffer.stream}", b'{"seq": 1}', timeout=2),
                nc.request(f"$JS.API.CONSUMER.CREATE.{buffer.stream}", b"{}", timeout=2),
                nc.request(f"$JS.API.STREAM.PURGE.{buffer.stream}", b"{}", timeout=2),
            )
        finally:
            await nc.close()

    run(go())
    assert {"logs.events", f"$KV.{naming.control_bucket('logs')}.parse"} <= violations(server, roles.READER)


def test_a_pipelines_user_reaches_its_own_pipeline_only(granted):
    server, specs = granted
    mine = naming.edge_partitions(specs.pipelines["logs"])[0]
    theirs = naming.edge_partitions(specs.pipelines["other"])[0]

    async def go():
        nc = await connect(as_role(server, roles.pipeline_user("logs")))
        try:
            js = nc.jetstream()
            # its own: publish a frame, read it back (direct get), put and get its control and status keys
            ack = await js.publish(mine.subject, b"frame", timeout=5)
            msg = await nc.request(f"$JS.API.DIRECT.GET.{mine.stream}", b'{"seq": %d}' % ack.seq, timeout=5)
            assert msg.data == b"frame"
            await st.set_desired(nc, "logs", "parse", st.Desired.DRAINING)
            assert await st.get_desired(nc, "logs", "parse") == st.Desired.DRAINING
            # the other pipeline's buffer, keys and purge: refused
            await refused_all(
                js.publish(theirs.subject, b"frame", timeout=2),
                nc.request(f"$JS.API.DIRECT.GET.{theirs.stream}", b'{"seq": 1}', timeout=2),
                nc.request(f"$JS.API.CONSUMER.CREATE.{theirs.stream}", b"{}", timeout=2),
                nc.request(f"$JS.API.STREAM.PURGE.{theirs.stream}", b"{}", timeout=2),
                st.set_desired(nc, "other", "parse", st.Desired.STOPPED),
                js.publish(f"$KV.{naming.control_bucket('other')}.parse", b"stopped", timeout=2),
                st.get_desired(nc, "other", "parse"),
            )
            # nor may it create or delete streams (provisioning is the admin's)
            await refused(nc.request(f"$JS.API.STREAM.DELETE.{mine.stream}", b"", timeout=2))
            # nor listen to another role's replies (the server never registers the subscription)
            stolen = await nc.subscribe("_INBOX_pipeline-other.>")
            own = await nc.subscribe("_INBOX_pipeline-logs.probe")
            await nc.flush()
            async with session(server.settings) as admin:
                await admin.publish("_INBOX_pipeline-other.reply", b"secret")
                await admin.publish("_INBOX_pipeline-logs.probe", b"marker")
                await admin.flush()
            assert (await own.next_msg(timeout=10)).data == b"marker"  # published after the secret
            assert stolen.pending_msgs == 0
        finally:
            await nc.close()

    run(go())
    seen = violations(server, roles.pipeline_user("logs"))
    assert {theirs.subject, f"$JS.API.DIRECT.GET.{theirs.stream}", f"$JS.API.STREAM.PURGE.{theirs.stream}",
            f"$KV.{naming.control_bucket('other')}.parse", "_INBOX_pipeline-other.>"} <= seen, seen


def test_a_server_started_before_roles_is_granted_nothing(nats_server, tmp_path):
    """A running server whose config does not include the users file (started by an older isbflow)
    cannot take role users by a reload: nothing is granted, so drivers keep the admin's settings."""
    specs = two_pipelines(tmp_path)
    conf = Path(nats_server.state.nodes[0].config)
    conf.write_text(conf.read_text().replace('include "auth.conf"', ""))
    assert not grant_pipelines(nats_server.data_dir, [roles.pipeline_grants(specs.pipelines["logs"])])
    assert not role_password_file(nats_server.data_dir, "pipeline-logs").exists()
    assert role_settings(nats_server.settings, nats_server.data_dir, "pipeline-logs") == nats_server.settings


def test_a_pipelines_user_cannot_deliver_into_another_pipeline(granted):
    """A push consumer's ``deliver_subject`` is not checked against its creator's publish rights
    (nats-server issue 8274): a pipeline user able to create a consumer on its own stream could have
    the server deliver that stream's messages into another pipeline's buffer or control key, through
    every consumer-create API form (the request body, not the subject, makes a consumer push)."""
    server, specs = granted
    mine = naming.edge_partitions(specs.pipelines["logs"])[0]
    theirs = naming.edge_partitions(specs.pipelines["other"])[0]
    control = f"$KV.{naming.control_bucket('other')}.parse"
    creates = [  # (API subject, consumer config): every form of the create request
        (f"$JS.API.CONSUMER.CREATE.{mine.stream}", {"deliver_subject": theirs.subject}),
        (f"$JS.API.CONSUMER.CREATE.{mine.stream}.into-control", {"name": "into-control", "deliver_subject": control}),
        (f"$JS.API.CONSUMER.CREATE.{mine.stream}.filtered.{mine.subject}",
         {"name": "filtered", "filter_subject": mine.subject, "deliver_subject": control}),
        (f"$JS.API.CONSUMER.DURABLE.CREATE.{mine.stream}.durable",
         {"durable_name": "durable", "deliver_subject": theirs.subject}),
    ]

    async def go():
        nc = await connect(as_role(server, roles.pipeline_user("logs")))
        try:
            await nc.jetstream().publish(mine.subject, b"stopped", timeout=5)  # its own buffer: allowed
            await refused_all(*(nc.request(subject, json.dumps({"stream_name": mine.stream, "config": {
                "ack_policy": "none", "deliver_policy": "all", **config}}).encode(), timeout=2)
                for subject, config in creates))
        finally:
            await nc.close()

    run(go())
    assert {subject for subject, _ in creates} <= violations(server, roles.pipeline_user("logs"))

    async def check():
        nc = await connect(server.settings)
        try:
            for _ in range(10):  # a delivery would land within milliseconds
                assert (await stream_state(nc, theirs.stream)).messages == 0
                assert await st.get_desired(nc, "other", "parse") != st.Desired.STOPPED
                await asyncio.sleep(0.1)
        finally:
            await nc.close()

    run(check())


def test_the_platforms_producer_publishes_as_the_producer_role_not_the_admin(granted, tmp_path):
    """``make run``'s producer (isbflow.platform.pipeline.start_producer) logs in as ``producer``:
    it publishes the demo's events, and holds no admin password."""
    import time

    from isbflow.local.procs import process_alive
    from isbflow.platform.pipeline import start_producer
    from isbflow.platform.state import PipelineOptions
    from isbflow.steps.launch import stop_process

    server, specs = granted
    p = specs.pipelines["logs"]
    proc = start_producer(server.data_dir, PipelineOptions(spec=str(tmp_path / "two.yaml"), rate=50,
                                                           count=1_000_000), p, server.settings, "marker", 0)
    try:
        environ: list[bytes] = []
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and not any(e.startswith(b"NATS_USER=") for e in environ):
            assert process_alive(proc.pid, proc.proc_start), Path(proc.log).read_text()[-2000:]
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")  # empty until exec'd
            time.sleep(0.1)
        assert b"NATS_USER=" + roles.PRODUCER.encode() in environ
        admin = (Path(server.data_dir) / "nats" / "password").read_text().strip().encode()
        assert not any(admin in e for e in environ)

        async def stored() -> int:
            async with session(server.settings) as nc:
                names = [n for n in await nc.jetstream().streams_info() if n.config.subjects and
                         "logs.events" in n.config.subjects]
                return names[0].state.messages if names else 0

        while time.monotonic() < deadline and asyncio.run(stored()) < 20:
            time.sleep(0.2)
        assert asyncio.run(stored()) >= 20, Path(proc.log).read_text()[-2000:]
    finally:
        stop_process(proc.pid, proc.proc_start, grace=2)


def test_a_pipeline_user_waits_on_its_own_buffers_wakes_and_never_on_anothers(granted):
    """An idle step waits for its input through the stream's RePublish (headers only), without a
    consumer: its user may subscribe to its own streams' wake subjects, not to another pipeline's."""
    from isbflow.isb.wait import wait_for_append

    server, specs = granted
    mine = naming.edge_partitions(specs.pipelines["logs"])[0]
    theirs = naming.edge_partitions(specs.pipelines["other"])[0]

    async def go():
        async with session(as_role(server, roles.pipeline_user("logs")), name="t-wake") as nc:
            async def later():
                await asyncio.sleep(0.5)
                await nc.jetstream().publish(mine.subject, b"frame")

            task = asyncio.create_task(later())
            woke = await wait_for_append(nc, {mine.stream: 0}, timeout=30)
            await task
            got = []

            async def collect(m):
                got.append(m)

            await nc.subscribe(naming.wake_subject(theirs.stream), cb=collect)
            await nc.flush()
            async with session(server.settings, name="t-admin") as admin:
                await admin.jetstream().publish(theirs.subject, b"frame")
                await asyncio.sleep(0.5)
        return woke, got

    woke, got = asyncio.run(go())
    assert woke is True
    assert got == [] and naming.wake_subject(theirs.stream) in violations(server, roles.pipeline_user("logs"))
