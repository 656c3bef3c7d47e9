"""The demo producer: deterministic events, acked publishes with stable ids, a real nats-server."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime

import pytest
from nats.js.api import StreamConfig

from isbflow.isb import naming
from isbflow.isb.connect import connect
from isbflow.isb.roles import pipeline_grants
from isbflow.isb.server import grant_pipelines
from isbflow.ops import produce as P
from isbflow.spec import load_specs
from tests.conftest import ROOT

SCHEMA_FIELDS = ["ts", "service", "level", "host", "latency_ms", "status", "msg"]


@pytest.fixture(scope="module")
def pipeline():
    return load_specs([ROOT / "pipelines" / "logs.yaml"]).only_pipeline()


async def _create_source_stream(settings, pipeline) -> str:
    name = naming.source_stream(pipeline, "in")
    nc = await connect(settings)
    try:
        await nc.jetstream().add_stream(StreamConfig(
            name=name, subjects=[pipeline.vertex("in").source.jetstream.subject], duplicate_window=120.0))
    finally:
        await nc.close()
    return name


async def _stored(settings, stream: str) -> list[tuple[str, dict | bytes]]:
    """(msg id, parsed body or raw bytes) of every message in the stream, in order."""
    nc = await connect(settings)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            m = await js.get_msg(stream, seq)
            try:
                body = json.loads(m.data)
            except ValueError:
                body = m.data
            out.append((m.headers["Nats-Msg-Id"], body))
        return out
    finally:
        await nc.close()


def test_events_are_deterministic_and_match_the_schema(pipeline):
    a = P.events(seed=7, start=0, count=2000)
    assert a == P.events(seed=7, start=0, count=2000)
    assert a[1000:] == P.events(seed=7, start=1000, count=1000)
    assert a != P.events(seed=8, start=0, count=2000)
    schema = pipeline.vertex("in").source.schema_
    assert [f.split()[0] for f in schema.split(", ")] == SCHEMA_FIELDS
    for e in a:
        assert list(e) == SCHEMA_FIELDS
        assert isinstance(e["latency_ms"], float) and e["latency_ms"] > 0
        assert isinstance(e["status"], int)
        assert e["level"] in {"INFO", "WARN", "ERROR", "DEBUG"}
        assert e["service"] in P.SERVICES and e["host"].startswith(e["service"] + "-")
        assert e["ts"].endswith("Z") and len(e["ts"]) == len("2025-01-01T00:00:00.000Z")
    # one hot service; event time out of order but bounded by MAX_JITTER
    counts = {s: sum(e["service"] == s for e in a) for s in P.SERVICES}
    assert max(counts, key=counts.get) == P.HOT_SERVICE and counts[P.HOT_SERVICE] > 0.3 * len(a)
    assert set(counts.values()) != {0} and min(counts.values()) > 0
    times = [datetime.fromisoformat(e["ts"].replace("Z", "+00:00")) for e in a]
    assert any(t2 < t1 for t1, t2 in zip(times, times[1:], strict=False)), "expected some disorder"
    for i, t in enumerate(times):
        assert P.event_time(i) - P.MAX_JITTER <= t <= P.event_time(i)
    assert {e["level"] for e in a} == {"INFO", "WARN", "ERROR", "DEBUG"}


def test_malformed_every_replaces_exactly_those_events():
    bodies = [b for _, b in P.iter_payloads(seed=1, start=0, count=30, malformed_every=5)]
    bad = []
    for i, b in enumerate(bodies):
        try:
            e = json.loads(b)
            ok = isinstance(e["latency_ms"], float) and isinstance(e["status"], int)
        except ValueError:
            ok = False
        if not ok:
            bad.append(i)
    assert bad == [4, 9, 14, 19, 24, 29]
    assert len(P.events(seed=1, start=0, count=30, malformed_every=5)) == 24


def test_produce_publishes_acked_with_stable_ids(nats_server, pipeline):
    settings = nats_server.settings
    stream = asyncio.run(_create_source_stream(settings, pipeline))
    seen: list[int] = []
    report = asyncio.run(P.produce(settings, pipeline, count=5000, seed=3, window=1000,
                                   malformed_every=1000, progress=seen.append))
    assert (report.published, report.duplicates, report.malformed) == (5000, 0, 5)
    assert sum(seen) == 5000
    assert report.stream == stream and report.subject == "logs.events"

    # the same range again (a retried run): nothing stored twice
    again = asyncio.run(P.produce(settings, pipeline, count=5000, seed=3, malformed_every=1000))
    assert (again.published, again.duplicates) == (0, 5000)
    # continuing the range stores only the new part
    more = asyncio.run(P.produce(settings, pipeline, count=100, seed=3, start=4950, malformed_every=1000))
    assert (more.published, more.duplicates) == (50, 50)

    stored = asyncio.run(_stored(settings, stream))
    assert [i for i, _ in stored] == [P.msg_id(3, i) for i in range(5050)]
    good = [b for _, b in stored if isinstance(b, dict) and isinstance(b.get("status"), int)]
    assert good == P.events(seed=3, start=0, count=5050, malformed_every=1000)


def test_rate_limited_run_finishes_with_every_event(nats_server, pipeline):
    settings = nats_server.settings
    asyncio.run(_create_source_stream(settings, pipeline))
    report = asyncio.run(P.produce(settings, pipeline, count=300, rate=1000, seed=9))
    assert report.published == 300 and report.duplicates == 0


def test_missing_source_stream_names_the_fix(nats_server, pipeline):
    with pytest.raises(P.SourceNotProvisioned, match=r"src-logs-in .*isbflow isb apply"):
        asyncio.run(P.produce(nats_server.settings, pipeline, count=1))


def test_source_vertex_must_be_a_jetstream_source(pipeline):
    assert P.source_vertex(pipeline) == "in"
    with pytest.raises(ValueError, match="'parse' is not a JetStream source vertex"):
        P.source_vertex(pipeline, "parse")


def test_cli_produce_reports_json_and_hints_at_apply(nats_server, pipeline):
    from typer.testing import CliRunner

    from isbflow.cli import app

    args = ["produce", "-f", str(ROOT / "pipelines" / "logs.yaml"), "--data-dir", str(nats_server.data_dir),
            "--count", "200", "--seed", "5", "--json"]
    missing = CliRunner().invoke(app, args)
    assert missing.exit_code == 1 and "isbflow isb apply" in missing.output
    asyncio.run(_create_source_stream(nats_server.settings, pipeline))
    missing = CliRunner().invoke(app, args)  # the stream alone: its producer may not publish there yet
    assert missing.exit_code == 1 and "not provisioned" in missing.output and "isbflow isb apply" in missing.output
    grant_pipelines(nats_server.data_dir, [pipeline_grants(pipeline)])  # what 'isb apply' does after creating it
    for published, duplicates in ((200, 0), (0, 200)):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert (report["published"], report["duplicates"], report["count"]) == (published, duplicates, 200)


def test_a_full_stream_refusing_messages_fails_with_the_reason(nats_server, pipeline):
    from nats.js.api import DiscardPolicy

    async def full_stream():
        nc = await connect(nats_server.settings)
        try:
            await nc.jetstream().add_stream(StreamConfig(
                name=naming.source_stream(pipeline, "in"), subjects=["logs.events"],
                max_msgs=10, discard=DiscardPolicy.NEW))
        finally:
            await nc.close()

    asyncio.run(full_stream())
    with pytest.raises(P.ProduceFailed, match=r"refused messages for logs.events .*maximum messages"):
        asyncio.run(P.produce(nats_server.settings, pipeline, count=100, window=5))


def test_event_times_shifted_to_a_chosen_start_keep_their_spacing():
    from datetime import UTC, timedelta

    t = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
    shift = P.shift_for(t, start=5000)
    for i in (5000, 5001, 9000):
        base = datetime.fromisoformat(P.log_event(3, i)["ts"])
        moved = datetime.fromisoformat(P.log_event(3, i, shift)["ts"])
        assert moved - base == timedelta(milliseconds=shift)  # same jitter, same spacing
        assert t + timedelta(milliseconds=10 * (i - 5000)) - P.MAX_JITTER <= moved \
            <= t + timedelta(milliseconds=10 * (i - 5000))
    assert {k: v for k, v in P.log_event(3, 7, shift).items() if k != "ts"} == \
        {k: v for k, v in P.log_event(3, 7).items() if k != "ts"}


def test_cli_produce_event_time_from_now(nats_server, pipeline):
    """The live demo's producer: events stamped from the moment it starts."""
    from datetime import UTC, timedelta

    from typer.testing import CliRunner

    from isbflow.cli import app

    stream = asyncio.run(_create_source_stream(nats_server.settings, pipeline))
    grant_pipelines(nats_server.data_dir, [pipeline_grants(pipeline)])
    before = datetime.now(UTC)
    result = CliRunner().invoke(app, ["produce", "-f", str(ROOT / "pipelines" / "logs.yaml"), "--data-dir",
                                      str(nats_server.data_dir), "--count", "20", "--seed", "41", "--start", "777",
                                      "--event-time-from", "now", "--json"])
    assert result.exit_code == 0, result.output
    stamped = [datetime.fromisoformat(body["ts"]) for mid, body in asyncio.run(_stored(nats_server.settings, stream))
               if mid.startswith("41-")]
    assert len(stamped) == 20
    assert all(before - P.MAX_JITTER - timedelta(seconds=1) <= t <= datetime.now(UTC) + timedelta(seconds=1)
               for t in stamped), stamped
    bad = CliRunner().invoke(app, ["produce", "-f", str(ROOT / "pipelines" / "logs.yaml"), "--data-dir",
                                   str(nats_server.data_dir), "--count", "1", "--event-time-from", "noon"])
    assert bad.exit_code == 2 and "--event-time-from 'noon'" in bad.output
