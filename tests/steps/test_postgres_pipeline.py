"""A pipeline into a PostgreSQL sink: real nats-server, real SparkSession, real PostgreSQL.

``tests/specs/postgres-sink.yaml``: JSON events on a source buffer, a transform,
and two sinks fed the same records, ``events`` (PostgreSQL, through the Airflow
connection ``pg_sinks`` the test defines in the environment) and ``raw``
(Delta). The PostgreSQL table is created from the transform's output schema,
holds every well-formed record once, and the sink's offsets reach the ledger.
A batch replayed after a crash between the PostgreSQL commit and Spark's
checkpoint commit commits nothing. recover refills the table after its buffer is lost.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from decimal import Decimal
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pytest
from deltalake import DeltaTable

from isbflow.isb import ledger, naming, provision
from isbflow.isb.connect import connect
from isbflow.isb.dlq import read_dead_letters
from isbflow.isb.state import StepStatus
from isbflow.quality.basis import read_ledger_basis
from isbflow.quality.run import run_quality
from isbflow.recovery.plan import plan_recover
from isbflow.recovery.recover import recover
from isbflow.spec import load_specs
from isbflow.spec.paths import DataDir
from isbflow.steps import sink_policy
from isbflow.steps.driver import LaunchError, sink_connections
from isbflow.steps.pg_sink import postgres_writer
from isbflow.steps.runner import PipelineRunner, StepError
from tests.conftest import ROOT
from tests.helpers.postgres import HOST, Postgres, running_postgres

pytestmark = pytest.mark.slow

SPEC = ROOT / "tests" / "specs" / "postgres-sink.yaml"


@pytest.fixture(scope="module")
def pg() -> Postgres:
    with running_postgres(db="landing", user="isb") as server:
        yield server


@pytest.fixture
def pg_conn(pg, monkeypatch):
    """The Airflow connection ``pg_sinks`` in Airflow's environment form, for the step's driver."""
    monkeypatch.setenv("AIRFLOW_CONN_PG_SINKS", f"postgres://{pg.user}:{pg.password}@{HOST}:{pg.port}/{pg.db}")
    query(pg, "DROP SCHEMA IF EXISTS landing CASCADE")
    return pg


def query(pg: Postgres, sql: str) -> list[tuple]:
    with psycopg.connect(host=HOST, port=pg.port, user=pg.user, password=pg.password, dbname=pg.db) as c:
        cur = c.execute(sql)
        return cur.fetchall() if cur.description else []


def setup(nats_server):
    specs = load_specs(SPEC)
    asyncio.run(provision.apply(nats_server.settings, specs))
    return specs, specs.only_pipeline()


async def _publish(settings, numbers, malformed: int = 0) -> None:
    nc = await connect(settings)
    try:
        js = nc.jetstream()
        for n in numbers:
            event = {"n": n, "service": f"s{n % 3}", "ts": f"2026-03-0{1 + n % 5}T10:00:00"}
            await js.publish("pgsink.events", json.dumps(event).encode(), headers={"Nats-Msg-Id": f"pg-{n}"})
        for i in range(malformed):
            await js.publish("pgsink.events", b"{not json", headers={"Nats-Msg-Id": f"pg-bad-{i}"})
    finally:
        await nc.close()


def run(spark, specs, p, settings, data_dir: Path, only: list[str] | None = None):
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    try:
        return runner.run_available_now(only=only)
    finally:
        runner.close()


def test_records_land_once_in_a_table_made_from_the_output_schema(spark, nats_server, pg_conn, tmp_path):
    pg, settings = pg_conn, nats_server.settings
    specs, p = setup(nats_server)
    asyncio.run(_publish(settings, range(1, 31), malformed=2))
    run(spark, specs, p, settings, tmp_path)

    types = dict(query(pg, "SELECT column_name, data_type FROM information_schema.columns "
                           "WHERE table_schema = 'landing' AND table_name = 'events'"))
    assert types == {"n": "integer", "service": "text", "ts": "timestamp with time zone", "_isb_id": "text",
                     "big": "bigint", "quarter": "numeric", "tags": "jsonb", "day": "date"}
    rows = query(pg, "SELECT n, big, quarter, tags, day FROM landing.events ORDER BY n")
    assert [r[0] for r in rows] == list(range(1, 31))  # the malformed two went to the dead letters
    assert rows[4] == (5, 5000, Decimal("1.25"), ["s2", "x"], dt.date(2026, 3, 1))
    assert query(pg, "SELECT count(DISTINCT _isb_id) FROM landing.events") == [(30,)]
    # the Delta sink fed the same records holds the same ids
    raw = DeltaTable(str(tmp_path / "sinks" / "raw")).to_pyarrow_table()
    assert {i for (i,) in query(pg, "SELECT _isb_id FROM landing.events")} == set(raw.column("_isb_id").to_pylist())

    # several micro-batches (readBatchSize 10), each one bookkeeping row with its offsets
    book = query(pg, "SELECT app_id, batch_id, written, offsets FROM landing.isb_sink_batches ORDER BY batch_id")
    assert len(book) >= 3 and {a for a, *_ in book} == {"pgsink/events"}
    assert sum(r for _, _, r, _ in book) == 30
    held = ledger.union(*(b[3] for b in book))
    kv = asyncio.run(_ledger(settings, p.name))
    assert kv["events"] == held  # the ledger KV advanced with the commits
    assert sum(ledger.count(r) for r in held.values()) == 30

    # more events: the next run adds only them
    asyncio.run(_publish(settings, range(31, 41)))
    run(spark, specs, p, settings, tmp_path)
    assert query(pg, "SELECT count(*), count(DISTINCT _isb_id), max(n) FROM landing.events") == [(40, 40, 40)]

    # the quality suite's completeness (on the offset ledger) and uniqueness run on the table
    good = run_quality(spark, p, "events", tmp_path, basis=read_ledger_basis(settings, p, tmp_path, wait_s=5))
    assert good.success and good.kind == "raw" and good.rows == 40, [c for c in good.checks if not c.success]
    assert good.table_path == "postgres:landing.events" and good.table_version == len(book) + 1
    checked = {c.name: c for c in good.checks}
    assert checked["completeness"].skipped is None and checked["uniqueness"].skipped is None
    # a row lost and an id twice (the key dropped first): both checks find them
    lost = query(pg, "DELETE FROM landing.events WHERE n = 7 RETURNING _isb_id")[0][0]
    query(pg, "ALTER TABLE landing.events DROP CONSTRAINT events_pkey")
    query(pg, "INSERT INTO landing.events SELECT * FROM landing.events WHERE n IN (3, 4)")
    bad = run_quality(spark, p, "events", tmp_path, basis=read_ledger_basis(settings, p, tmp_path, wait_s=5))
    failed = {c.name: c for c in bad.checks if not c.success}
    assert set(failed) == {"completeness", "uniqueness"} and bad.gate_failed
    assert failed["completeness"].unexpected_count == 1 and failed["completeness"].samples == [lost]
    assert failed["uniqueness"].unexpected_count == 2


async def _ledger(settings, pipeline: str):
    nc = await connect(settings)
    try:
        return await ledger.read(nc, pipeline)
    finally:
        await nc.close()


def test_a_batch_replayed_after_a_crash_commits_nothing(spark, nats_server, pg_conn, tmp_path):
    """Spark replays a batch whose sink commit landed but whose checkpoint commit did not (the
    driver died between the two): here, the last commit file of the sink's checkpoint is removed.
    The batch's rows are also deleted from the table, so a replay that wrote anything would show:
    the bookkeeping row alone makes the replay commit nothing."""
    pg, settings = pg_conn, nats_server.settings
    specs, p = setup(nats_server)
    asyncio.run(_publish(settings, range(1, 26)))
    run(spark, specs, p, settings, tmp_path)
    commits = Path(DataDir(tmp_path).checkpoint(p.name, "events", None)) / "commits"
    last = max(int(f.name) for f in commits.iterdir() if f.name.isdigit())
    (offsets_before,) = query(pg, f"SELECT offsets FROM landing.isb_sink_batches WHERE batch_id = {last}")[0]
    batch_ids = ", ".join(f"'{k}/{s}'" for k, ranges in offsets_before.items()
                          for lo, hi in ranges for s in range(lo, hi + 1))
    query(pg, f"DELETE FROM landing.events WHERE _isb_id IN ({batch_ids})")
    left = query(pg, "SELECT count(*) FROM landing.events")[0][0]
    assert 0 < left < 25
    for f in (commits / str(last), commits / f".{last}.crc"):  # Hadoop's checksum beside it
        f.unlink(missing_ok=True)

    run(spark, specs, p, settings, tmp_path)
    assert (commits / str(last)).exists()  # Spark did run batch `last` again
    assert query(pg, "SELECT count(*) FROM landing.events")[0][0] == left  # and it committed nothing
    assert query(pg, f"SELECT count(*) FROM landing.isb_sink_batches WHERE batch_id >= {last}") == [(1,)]


def test_a_bad_connection_fails_the_step_naming_sink_and_connection(spark, nats_server, pg, monkeypatch, tmp_path):
    wrong = "not-the-Pa55word"
    monkeypatch.setenv("AIRFLOW_CONN_PG_SINKS", f"postgres://{pg.user}:{wrong}@{HOST}:{pg.port}/{pg.db}")
    specs, p = setup(nats_server)
    runner = PipelineRunner(spark, specs, p, nats_server.settings, tmp_path)
    try:
        with pytest.raises(StepError) as e:
            runner.run_available_now(only=["events"])
    finally:
        runner.close()
    text = str(e.value)
    assert "step 'events': postgres sink 'events' (table landing.events, connection 'pg_sinks'): " \
           "cannot connect:" in text and "password authentication failed" in text, text
    assert wrong not in text and pg.password not in text


async def _delete_stream(settings, stream: str) -> None:
    nc = await connect(settings)
    try:
        await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


def test_recover_refills_a_postgres_sink_after_its_buffer_is_lost(spark, nats_server, pg_conn, tmp_path):
    """Records 1..20 reach both sinks; 21..40 sit in the buffers shape -> events and shape -> raw when
    shape -> events is deleted. recover rewinds to the low offset the PostgreSQL sink's bookkeeping
    (and the ledger) give, replays in merge mode, and verifies the table: 1..40, each once."""
    pg, settings = pg_conn, nats_server.settings
    specs, p = setup(nats_server)
    asyncio.run(_publish(settings, range(1, 21)))
    run(spark, specs, p, settings, tmp_path)
    asyncio.run(_publish(settings, range(21, 41)))
    run(spark, specs, p, settings, tmp_path, only=["in", "shape"])
    lost = naming.EdgePartition(p.name, "shape", "events", 0).stream
    asyncio.run(_delete_stream(settings, lost))

    plan = plan_recover(spark, specs, p, settings, tmp_path)  # the dry run reads the same offsets
    assert plan.state == "would-recover" and plan.records_to_replay == 20 and "events" in plan.id_sinks
    report = recover(spark, specs, p, settings, tmp_path)
    assert report.ok, json.dumps(report.to_json(), default=str)
    assert [b.stream for b in report.lost] == [lost]
    assert report.low_offsets["in/0"]["low"] == 21  # what both sinks' commits hold: 1..20
    events = next(s for s in report.sinks if s.sink == "events")
    assert (events.verified, events.duplicates, events.missing, events.rows) == (True, 0, 0, 40)
    assert events.inserted == 20
    assert query(pg, "SELECT count(*), count(DISTINCT _isb_id), min(n), max(n) FROM landing.events") == \
        [(40, 40, 1, 40)]
    # the replay committed under the new checkpoint epoch's app id
    assert {a for (a,) in query(pg, "SELECT DISTINCT app_id FROM landing.isb_sink_batches")} == \
        {"pgsink/events", "pgsink/events#e1"}


def test_only_the_sinks_connections_reach_a_launched_driver(tmp_path):
    p = load_specs(SPEC).only_pipeline()
    base = {"AIRFLOW_CONN_PG_SINKS": "postgres://u:p@h/d", "AIRFLOW_CONN_OTHER": "postgres://x:y@h/d",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://a:b@h/airflow", "HOME": "/root"}
    assert sink_connections(p, base) == {"AIRFLOW_CONN_PG_SINKS": "postgres://u:p@h/d"}
    assert sink_connections(p, {}) == {}  # not defined: the sink's own error names the variable
    # a connection of another type (the ISB admin's nats_default, say) is refused, never passed on
    nats = json.dumps({"conn_type": "nats", "host": "127.0.0.1:4222", "login": "isbflow", "password": "admin"})
    with pytest.raises(LaunchError, match=r"pipeline 'pgsink', postgres sink 'events': sink.postgres.connection "
                       r"'pg_sinks' \(AIRFLOW_CONN_PG_SINKS\) is a connection of type 'nats', not postgres"):
        sink_connections(p, {"AIRFLOW_CONN_PG_SINKS": nats})


def with_policy(line: str, fallback: str) -> str:
    """A sink's spec ``line`` (kept) followed by Numaflow's retryStrategy (2 attempts 10 ms apart, then
    fallback) and a Delta fallback at ``fallback``."""
    return (f"{line}        retryStrategy:\n          backoff:\n            interval: 10ms\n            steps: 2\n"
            f"          onFailure: fallback\n        fallback:\n          delta:\n            path: {fallback}\n")


POLICY = with_policy("          connection: pg_sinks\n", "sinks/events-failed")


def test_postgres_stopped_mid_run_retries_then_falls_back_and_the_step_goes_on(spark, nats_server, pg_conn,
                                                                              tmp_path):
    """The sink ``events`` with Numaflow's retryStrategy (2 attempts, then fallback) and a Delta fallback,
    its ``foreachBatch`` function (the runner's, under the sink policy) driven with DataFrames of the
    session's Spark, batch by batch as a query would: real PostgreSQL, NATS (ledger, dead letters).

    Batch 0 lands in PostgreSQL; the server stops; batches 1 and 2 are tried twice each and go to the
    fallback with reason and attempts; batch 2 replayed (Spark re-runs a batch whose checkpoint commit
    did not land) with the server back writes nothing anywhere; batch 3 lands again but for 37, which a
    CHECK refuses alone: it goes to the fallback with the server's reason. The same sink without a
    fallback dead-letters the row it refuses (47). Table + fallback + dead letters == produced, no id
    twice, and the ledger holds every offset. (The runner's wiring of the policy into a query runs in
    every other test of this file.)"""
    pg, settings = pg_conn, nats_server.settings
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.read_text().replace("          connection: pg_sinks\n", POLICY))
    specs = load_specs(spec)
    asyncio.run(provision.apply(settings, specs))
    p = specs.only_pipeline()
    fallback = tmp_path / "sinks" / "events-failed"
    cols = "n INT, service STRING, _isb_id STRING"

    def batch(ns):
        return spark.createDataFrame([(n, f"s{n % 3}", f"in/0/{n}") for n in ns], cols)

    def sink(specs_):
        runner = PipelineRunner(spark, specs_, specs_.only_pipeline(), settings, tmp_path)
        v = runner.p.vertex("events")
        return runner, sink_policy.policy_for(runner, v, postgres_writer(runner, v, ["n", "service", "_isb_id"],
                                                                         "append", None, None))

    runner, write = sink(specs)
    try:
        write(batch(range(1, 11)), 0)
        assert query(pg, "SELECT count(*) FROM landing.events") == [(10,)]
        try:
            pg.stop()
            write(batch(range(11, 21)), 1)
            write(batch(range(21, 31)), 2)
        finally:
            pg.start()
        held = DeltaTable(str(fallback)).to_pyarrow_table()
        assert sorted(held.column("n").to_pylist()) == list(range(11, 31))
        assert set(held.column("_isb_attempts").to_pylist()) == {2} and sorted(set(held.column("_isb_batch")
                                                                                  .to_pylist())) == [1, 2]
        assert set(held.column("_isb_app").to_pylist()) == {"pgsink/events"}
        assert all("2 attempts failed, the last:" in e and "cannot connect" in e
                   for e in held.column("_isb_error").to_pylist())
        status = StepStatus("events")
        sink_policy.fold_status(status, write)
        assert (status.sink_retries, status.fallback_total, status.dropped_total, status.sink_error) == (4, 20, 0, None)

        write(batch(range(21, 31)), 2)  # the replay, the server back: the fallback holds batch 2 whole
        assert query(pg, "SELECT count(*) FROM landing.events") == [(10,)]
        assert DeltaTable(str(fallback)).to_pyarrow_dataset().count_rows() == 20

        # the step goes on; a row the table refuses alone goes to the fallback, the rest commits
        query(pg, "ALTER TABLE landing.events ADD CONSTRAINT no_37 CHECK (n <> 37)")
        write(batch(range(31, 41)), 3)
        refused = DeltaTable(str(fallback)).to_pyarrow_table().filter(pa.compute.field("n") == 37)
        assert refused.num_rows == 1 and "no_37" in refused.column("_isb_error")[0].as_py()
        assert refused.column("_isb_attempts")[0].as_py() == 1
        sink_policy.fold_status(status, write)
        assert (status.fallback_total, status.refused_total, status.sink_retries) == (21, 1, 4)
    finally:
        runner.close()

    # the same sink without a fallback: the row it refuses goes to the dead-letter buffer, with its reason
    query(pg, "ALTER TABLE landing.events ADD CONSTRAINT no_47 CHECK (n <> 47)")
    plain, write = sink(load_specs(SPEC))
    try:
        write(batch(range(41, 51)), 4)
        assert write.totals.dead_lettered == 1
    finally:
        plain.close()
    (letter,) = asyncio.run(read_dead_letters(settings, p.name))
    assert letter["origin"] == "in/0/47" and "refused by sink 'events'" in letter["reason"] \
        and "no_47" in letter["reason"]

    primary = {i for (i,) in query(pg, "SELECT _isb_id FROM landing.events")}
    in_fallback = DeltaTable(str(fallback)).to_pyarrow_table().column("_isb_id").to_pylist()
    assert sorted(n for (n,) in query(pg, "SELECT n FROM landing.events")) == [
        *range(1, 11), *range(31, 37), *range(38, 47), *range(48, 51)]
    assert len(primary) + len(in_fallback) + 1 == 50
    assert not primary & set(in_fallback) and len(set(in_fallback)) == len(in_fallback)
    # the ledger holds every offset: those in the table and those sent to the fallback
    assert asyncio.run(_ledger(settings, p.name))["events"] == {"in/0": [[1, 50]]}


DELTA_POLICY = with_policy("          path: sinks/raw\n", "sinks/raw-failed")


def test_a_delta_sink_whose_storage_is_gone_retries_then_falls_back_and_the_step_goes_on(spark, nats_server,
                                                                                        tmp_path):
    """The Delta sink ``raw`` with Numaflow's retryStrategy (2 attempts, then fallback) and a Delta fallback,
    run by the runner's own queries (available-now; ``in``, ``shape``, ``raw``: no PostgreSQL). A file where
    its table's folder goes (storage that is not there): every batch is tried twice and lands in the
    fallback with reason and attempts, and the step's status counts both; the storage back, the next run
    lands in the table. Table + fallback == produced, no id twice, the ledger holds every offset, and
    quality's completeness passes with the fallback's records accounted for."""
    settings = nats_server.settings
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.read_text().replace("          path: sinks/raw\n", DELTA_POLICY))
    specs = load_specs(spec)
    asyncio.run(provision.apply(settings, specs))
    p = specs.only_pipeline()
    data = tmp_path / "data"
    raw, fallback = data / "sinks" / "raw", data / "sinks" / "raw-failed"
    steps = ["in", "shape", "raw"]

    def ns(path: Path) -> list[int]:
        return sorted(DeltaTable(str(path)).to_pyarrow_table().column("n").to_pylist())

    raw.parent.mkdir(parents=True)
    raw.write_text("the sink's storage is gone\n")
    asyncio.run(_publish(settings, range(1, 21)))
    try:
        status = run(spark, specs, p, settings, data, only=steps)["raw"]
    finally:
        raw.unlink()
    held = DeltaTable(str(fallback)).to_pyarrow_table()
    assert sorted(held.column("n").to_pylist()) == list(range(1, 21))
    assert set(held.column("_isb_attempts").to_pylist()) == {2}
    assert set(held.column("_isb_app").to_pylist()) == {"pgsink/raw"}
    assert all(e.startswith("sink 'raw': 2 attempts failed, the last:") for e in held.column("_isb_error").to_pylist())
    batches = len(set(held.column("_isb_batch").to_pylist()))
    assert status.fallback_total == 20 and status.sink_retries == 2 * batches and status.sink_error is None

    asyncio.run(_publish(settings, range(21, 31)))
    status = run(spark, specs, p, settings, data, only=steps)["raw"]
    assert ns(raw) == list(range(21, 31)) and ns(fallback) == list(range(1, 21))
    assert (status.fallback_total, status.sink_retries) == (20, 2 * batches)  # kept for the next driver
    in_table = DeltaTable(str(raw)).to_pyarrow_table().column("_isb_id").to_pylist()
    assert len(set(in_table)) == 10 and not set(in_table) & set(held.column("_isb_id").to_pylist())
    # the ledger holds every offset: those in the table and those sent to the fallback
    assert asyncio.run(_ledger(settings, p.name))["raw"] == {"in/0": [[1, 30]]}
    # and quality's completeness counts the fallback's records as accounted for, not missing
    report = run_quality(spark, p, "raw", data, basis=read_ledger_basis(settings, p, data, wait_s=5))
    (complete,) = [c for c in report.checks if c.name == "completeness"]
    assert complete.success and complete.details["in_fallback"] == 20, complete
    assert complete.details["proven"] == {"in/0": [[1, 30]]}, complete
