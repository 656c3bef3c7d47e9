"""The demo's transforms (spark_apps/logs.py) on real Spark, checked against pure-Python recomputation."""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
from pyspark.sql import functions as F

from isbflow.ops import produce as P
from isbflow.spec import load_specs
from spark_apps import logs
from tests.conftest import ROOT

SEED, COUNT = 11, 30_000  # 5 minutes of event time


@pytest.fixture(scope="module")
def source(spark):
    """The events as the source step hands them on: from_json of each payload, plus _isb_id."""
    schema = load_specs([ROOT / "pipelines" / "logs.yaml"]).only_pipeline().vertex("in").source.schema_
    raw = spark.createDataFrame([(b.decode(), f"in/0/{i + 1}") for i, (_, b) in
                                 enumerate(P.iter_payloads(SEED, 0, COUNT))], "value STRING, _isb_id STRING")
    return raw.select(F.from_json("value", schema).alias("e"), "_isb_id").select("e.*", "_isb_id")


def _ts(e: dict) -> datetime:
    return datetime.fromisoformat(e["ts"].replace("Z", "+00:00"))


def test_parse_normalises_and_flags_errors(spark):
    rows = [(datetime(2025, 1, 1), " Checkout ", "warning", "h", 1.0, 200, "m", "id1"),
            (datetime(2025, 1, 1), "auth", "info ", "h", 1.0, 503, "m", "id2"),
            (datetime(2025, 1, 1), "auth", "ERROR", "h", 1.0, 200, "m", "id3"),
            (datetime(2025, 1, 1), "auth", "DEBUG", "h", 1.0, None, "m", "id4")]
    df = spark.createDataFrame(rows, "ts TIMESTAMP, service STRING, level STRING, host STRING, "
                                     "latency_ms DOUBLE, status INT, msg STRING, _isb_id STRING")
    out = {r["_isb_id"]: r for r in logs.parse(df).collect()}
    assert (out["id1"]["service"], out["id1"]["level"], out["id1"]["is_error"]) == ("checkout", "WARN", False)
    assert (out["id2"]["level"], out["id2"]["is_error"]) == ("INFO", True)
    assert out["id3"]["is_error"] is True and out["id4"]["is_error"] is False


def test_parse_keeps_every_event_and_its_id(source):
    parsed = logs.parse(source)
    assert parsed.count() == COUNT
    assert parsed.filter(F.col("ts").isNull()).count() == 0  # every ts parsed from ISO-8601
    expected = sum(1 for e in P.events(SEED, 0, COUNT) if e["status"] >= 500 or e["level"] == "ERROR")
    assert parsed.filter("is_error").count() == expected
    assert parsed.select("_isb_id").distinct().count() == COUNT


def test_enrich_joins_teams_and_marks_unknown_services(spark, source):
    services = spark.createDataFrame([("checkout", "commerce", 1), ("auth", "identity", 1)],
                                     "service STRING, team STRING, tier INT")
    out = logs.enrich(logs.parse(source), services)
    assert out.count() == COUNT
    teams = {r["service"]: (r["team"], r["tier"]) for r in out.select("service", "team", "tier").distinct().collect()}
    assert teams["checkout"] == ("commerce", 1) and teams["auth"] == ("identity", 1)
    assert teams["payments"] == ("unknown", None)
    assert set(teams) == set(P.SERVICES)


def test_per_minute_equals_a_python_recomputation(spark, source):
    services = spark.createDataFrame([("checkout", "commerce", 1)], "service STRING, team STRING, tier INT")
    got = logs.per_minute(logs.enrich(logs.parse(source), services)).collect()
    assert set(got[0].asDict()) == {"window_start", "window_end", "service", "count", "errors",
                                    "latency_avg", "latency_p95"}

    groups: dict[tuple[datetime, str], list[dict]] = defaultdict(list)
    for e in P.events(SEED, 0, COUNT):
        t = _ts(e)
        groups[(t.replace(second=0, microsecond=0), e["service"])].append(e)
    assert len(got) == len(groups)
    for r in got:
        start = r["window_start"].replace(tzinfo=UTC)
        assert r["window_end"].replace(tzinfo=UTC) - start == timedelta(minutes=1)
        evs = groups[(start, r["service"])]
        lat = sorted(e["latency_ms"] for e in evs)
        assert r["count"] == len(evs)
        assert r["errors"] == sum(1 for e in evs if e["status"] >= 500 or e["level"] == "ERROR")
        assert r["latency_avg"] == pytest.approx(sum(lat) / len(lat))
        # percentile_approx: the smallest value with at least 95% of values <= it (exact at this size)
        assert r["latency_p95"] == lat[max(math.ceil(0.95 * len(lat)) - 1, 0)]
    # the hot service dominates every full minute
    minute = max(s for s, _ in groups)
    per_service = {svc: len(v) for (s, svc), v in groups.items() if s == minute - timedelta(minutes=1)}
    assert max(per_service, key=per_service.get) == P.HOT_SERVICE


def test_the_chain_runs_as_a_stream_from_landed_files(spark, tmp_path):
    """parse -> enrich -> per_minute in a streaming query (append mode, watermark) over isb-files."""
    from isbflow.connector.files import FilesDataSource, land

    spark.dataSource.register(FilesDataSource)
    for k in range(3):
        land(tmp_path / "in", f"{k:04d}.jsonl", [b for _, b in P.iter_payloads(SEED, k * 10_000, 10_000)])
    schema = load_specs([ROOT / "pipelines" / "logs.yaml"]).only_pipeline().vertex("in").source.schema_
    services = spark.createDataFrame([("checkout", "commerce", 1)], "service STRING, team STRING, tier INT")
    stream = (spark.readStream.format("isb-files").option("path", str(tmp_path / "in"))
              .option("readMaxRows", "10000").load()
              .select(F.from_json("value", schema).alias("e"), "_isb_id").select("e.*", "_isb_id"))
    emitted: list[dict] = []
    q = (logs.per_minute(logs.enrich(logs.parse(stream), services)).writeStream.outputMode("append")
         .foreachBatch(lambda df, _: emitted.extend(r.asDict() for r in df.collect()))
         .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())
    q.awaitTermination(300)
    assert q.exception() is None

    groups: dict[tuple[datetime, str], list[dict]] = defaultdict(list)
    for e in P.events(SEED, 0, COUNT):
        groups[(_ts(e).replace(second=0, microsecond=0), e["service"])].append(e)
    assert emitted, "windows behind the watermark must be emitted"
    keys = [(r["window_start"].replace(tzinfo=UTC), r["service"]) for r in emitted]
    assert len(keys) == len(set(keys))  # append mode: each window once
    for r, key in zip(emitted, keys, strict=True):
        assert r["count"] == len(groups[key])


def test_per_minute_in_update_mode_emits_every_window_open_ones_too(spark, tmp_path):
    """The spec runs per_minute with output: update: the latest row of each window over all
    micro-batches equals the batch result, windows the watermark never closed included."""
    from isbflow.connector.files import FilesDataSource, land

    spark.dataSource.register(FilesDataSource)
    for k in range(3):
        land(tmp_path / "in", f"{k:04d}.jsonl", [b for _, b in P.iter_payloads(SEED, k * 10_000, 10_000)])
    schema = load_specs([ROOT / "pipelines" / "logs.yaml"]).only_pipeline().vertex("in").source.schema_
    services = spark.createDataFrame([("checkout", "commerce", 1)], "service STRING, team STRING, tier INT")
    stream = (spark.readStream.format("isb-files").option("path", str(tmp_path / "in"))
              .option("readMaxRows", "10000").load()
              .select(F.from_json("value", schema).alias("e"), "_isb_id").select("e.*", "_isb_id"))
    latest: dict[tuple[datetime, str], dict] = {}
    batches: list[int] = []

    def keep_latest(df, batch_id):
        batches.append(batch_id)
        for r in df.collect():
            latest[(r["window_start"].replace(tzinfo=UTC), r["service"])] = r.asDict()

    q = (logs.per_minute(logs.enrich(logs.parse(stream), services)).writeStream.outputMode("update")
         .foreachBatch(keep_latest)
         .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())
    q.awaitTermination(300)
    assert q.exception() is None
    assert len(batches) >= 3  # three files of 10,000 rows: several batches changed windows

    groups: dict[tuple[datetime, str], list[dict]] = defaultdict(list)
    for e in P.events(SEED, 0, COUNT):
        groups[(_ts(e).replace(second=0, microsecond=0), e["service"])].append(e)
    assert set(latest) == set(groups)  # every window, the last (still open) minutes too
    newest = max(start for start, _ in groups)
    assert any(start == newest for start, _ in latest)
    for key, r in latest.items():
        evs = groups[key]
        assert r["count"] == len(evs), key
        assert r["errors"] == sum(1 for e in evs if e["status"] >= 500 or e["level"] == "ERROR"), key
