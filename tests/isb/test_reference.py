"""Reference tables in a KV bucket: put, load, and a cache that reloads only on change."""

from __future__ import annotations

import asyncio
import json

import pytest

from isbflow.cli.ref import read_rows, reference_key
from isbflow.isb import reference as R
from isbflow.spec import load_specs
from tests.conftest import ROOT

SERVICES_FILE = ROOT / "pipelines" / "reference" / "services.json"


@pytest.fixture(params=["jetstream", "redis"])
def store(request):
    """The settings of a real server of each store: a table behaves the same on both."""
    if request.param == "jetstream":
        return request.getfixturevalue("nats_server").settings
    return request.getfixturevalue("redis_server").settings()


def test_put_then_load_round_trips_and_skips_unchanged_rows(store):
    settings = store
    rows = json.loads(SERVICES_FILE.read_text())
    first = asyncio.run(R.put(settings, "logs", "services", rows))
    assert (first["written"], first["unchanged"], first["deleted"]) == (len(rows), 0, 0)
    again = asyncio.run(R.put(settings, "logs", "services", rows))
    assert (again["written"], again["unchanged"]) == (0, len(rows))
    assert again["revision"] == first["revision"]
    assert asyncio.run(R.revision(settings, "logs", "services")) == first["revision"]

    rev, table = asyncio.run(R.load(settings, "logs", "services", key="service"))
    assert rev == first["revision"]
    assert table.column_names[0] == "service"
    assert table.to_pylist() == [{"service": k, **rows[k]} for k in sorted(rows)]

    # replace deletes keys absent from the new rows
    fewer = {k: v for k, v in rows.items() if k != "users"}
    out = asyncio.run(R.put(settings, "logs", "services", fewer, replace=True))
    assert out["deleted"] == 1
    _, table = asyncio.run(R.load(settings, "logs", "services", key="service"))
    assert "users" not in table.column("service").to_pylist()


def test_missing_table_and_bad_rows_are_named(store):
    with pytest.raises(R.ReferenceError, match=r"'services' of pipeline logs does not exist.*isbflow ref put"):
        asyncio.run(R.load(store, "logs", "services"))
    with pytest.raises(R.ReferenceError, match=r"'services' of pipeline logs does not exist"):
        asyncio.run(R.revision(store, "logs", "services"))
    with pytest.raises(R.ReferenceError, match="reference key 'a b' is not allowed"):
        R.check_rows({"a b": {"team": "x"}})


def test_cache_reloads_only_when_the_revision_moves(nats_server, spark):
    settings = nats_server.settings
    asyncio.run(R.put(settings, "logs", "services", {"auth": {"team": "identity", "tier": 1}}))
    cache = R.ReferenceCache(settings, "logs", "services", key="service")
    df = cache.dataframe(spark)
    assert [r.asDict() for r in df.collect()] == [{"service": "auth", "team": "identity", "tier": 1}]
    assert cache.dataframe(spark) is df and cache.loads == 1  # unchanged revision: no reload

    asyncio.run(R.put(settings, "logs", "services", {"auth": {"team": "security", "tier": 1}}))
    df2 = cache.dataframe(spark)
    assert cache.loads == 2 and df2 is not df
    assert [r.team for r in df2.collect()] == ["security"]
    # the broadcast hint is on the plan
    assert "broadcast" in df2._jdf.queryExecution().logical().toString().lower()


def test_cli_reads_json_and_jsonl_with_the_spec_key(tmp_path):
    pipeline = load_specs([ROOT / "pipelines" / "logs.yaml"]).only_pipeline()
    assert reference_key(pipeline, "services") == "service"
    with pytest.raises(ValueError, match="no step references 'teams'"):
        reference_key(pipeline, "teams")
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_text('{"service": "auth", "team": "identity"}\n\n{"service": "users", "team": "identity"}\n')
    assert read_rows(jsonl, "service") == {"auth": {"team": "identity"}, "users": {"team": "identity"}}
    assert read_rows(SERVICES_FILE, "service") == json.loads(SERVICES_FILE.read_text())
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"service": "auth"}\n{oops\n')
    with pytest.raises(ValueError, match=r"b.jsonl:2: not JSON"):
        read_rows(bad, "service")


def test_cli_put_and_load(nats_server):
    from typer.testing import CliRunner

    from isbflow.cli import app

    common = ["-f", str(ROOT / "pipelines" / "logs.yaml"), "--name", "services",
              "--data-dir", str(nats_server.data_dir), "--json"]
    missing = CliRunner().invoke(app, ["ref", "load", *common])
    assert missing.exit_code == 1 and "isbflow ref put" in missing.output
    put = CliRunner().invoke(app, ["ref", "put", *common, "--from-file", str(SERVICES_FILE)])
    assert put.exit_code == 0, put.output
    assert json.loads(put.stdout)["written"] == 8
    loaded = CliRunner().invoke(app, ["ref", "load", *common])
    assert loaded.exit_code == 0, loaded.output
    rows = json.loads(loaded.stdout)["rows"]
    assert {r["service"]: r["team"] for r in rows}["checkout"] == "commerce"
