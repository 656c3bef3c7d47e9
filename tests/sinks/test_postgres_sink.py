"""The PostgreSQL sink's driver-side commit, on a real PostgreSQL server (no Spark here).

The server is a throwaway cluster from Debian's binaries
(:func:`tests.helpers.postgres.running_postgres`), with password auth: the
sink gets its password only from ``AIRFLOW_CONN_<ID>`` or a password file, as
in production. The Spark side (a pipeline into a PostgreSQL sink) is in
``tests/steps/test_postgres_pipeline.py``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from isbflow.sinks.pg_read import read_snapshot
from isbflow.sinks.postgres import (
    PostgresSinkError,
    PostgresTarget,
    airflow_connection,
    commit_batch,
    committed_offsets,
    connect,
    connect_kwargs,
)
from isbflow.spec.paths import SECRETS_ENV
from isbflow.spec.postgres import PostgresSink
from tests.helpers.postgres import HOST, Postgres, running_postgres

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    with running_postgres(db="sinks", user="isb") as server:
        yield server


def conn_env(pg: Postgres, conn_id: str = "pg_sinks", password: str | None = None) -> dict[str, str]:
    """``AIRFLOW_CONN_<ID>`` as Airflow's environment form (URI) for the test server."""
    return {f"AIRFLOW_CONN_{conn_id.upper()}":
            f"postgres://{pg.user}:{password or pg.password}@{HOST}:{pg.port}/{pg.db}"}


def target(pg: Postgres, table: str, app: str = "p/raw", **kw) -> PostgresTarget:
    return PostgresTarget(sink="raw", spec=PostgresSink(table=table, connection="pg_sinks"), app_id=app,
                          environ=conn_env(pg), **kw)


def query(pg: Postgres, sql: str) -> list[tuple]:
    """Run ``sql`` (committed); its rows, if it returns any."""
    with psycopg.connect(host=HOST, port=pg.port, user=pg.user, password=pg.password, dbname=pg.db) as c:
        cur = c.execute(sql)
        return cur.fetchall() if cur.description else []


def batch(seqs, partition: str = "in/0") -> pa.Table:
    seqs = list(seqs)
    return pa.table({
        "n": pa.array(seqs, pa.int32()),
        "msg": pa.array([f"m{s}" for s in seqs], pa.string()),
        "at": pa.array([dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=s) for s in seqs],
                       pa.timestamp("us", tz="UTC")),
        "tags": pa.array([["a", str(s)] for s in seqs], pa.list_(pa.string())),
        "_isb_id": pa.array([f"{partition}/{s}" for s in seqs], pa.string()),
    })


def test_the_table_is_created_from_the_batch_schema_keyed_on_isb_id(pg):
    t = target(pg, "created")
    out = commit_batch(t, batch(range(1, 6)), 0)
    assert (out.rows, out.written, out.skipped_reason) == (5, 5, None)
    types = dict(query(pg, "SELECT column_name, data_type FROM information_schema.columns "
                           "WHERE table_name = 'created'"))
    assert types == {"n": "integer", "msg": "text", "at": "timestamp with time zone", "tags": "jsonb",
                     "_isb_id": "text"}
    key = query(pg, "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
                    "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = 'created'::regclass AND i.indisprimary")
    assert key == [("_isb_id",)]
    rows = query(pg, "SELECT n, msg, at, tags FROM created ORDER BY n")
    assert rows[0] == (1, "m1", dt.datetime(2026, 1, 1, 0, 0, 1, tzinfo=dt.UTC), ["a", "1"])
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5]


def test_a_replayed_batch_commits_nothing_and_an_id_is_never_twice(pg):
    t = target(pg, "once")
    first = commit_batch(t, batch(range(1, 11)), 0)
    assert first.written == 10 and first.offsets == {"in/0": [[1, 10]]}
    again = commit_batch(t, batch(range(1, 11)), 0)  # Spark replays batch 0 after a crash
    assert again.written == 0 and again.skipped_reason == "table already holds batch 0"
    older = commit_batch(t, batch(range(50, 60)), 0)  # same batch id, other rows: still nothing
    assert older.written == 0
    # a new batch overlapping ids already held inserts only the new ones
    third = commit_batch(t, batch(range(8, 16)), 1)
    assert third.written == 5
    assert query(pg, "SELECT count(*), count(DISTINCT _isb_id) FROM once") == [(15, 15)]
    book = query(pg, "SELECT app_id, batch_id, sink, rows, written, offsets FROM isb_sink_batches "
                     "WHERE app_id = 'p/raw' AND target = 'once' ORDER BY batch_id")
    assert [(a, b, s, r, w) for a, b, s, r, w, _ in book] == [("p/raw", 0, "raw", 10, 10),
                                                              ("p/raw", 1, "raw", 8, 5)]
    assert book[1][5] == {"in/0": [[8, 15]]}
    assert committed_offsets(t) == {"in/0": [[1, 15]]}
    # another app id (a recovery's new checkpoint epoch) starts its own batch ids
    other = commit_batch(target(pg, "once", app="p/raw#e1"), batch(range(14, 18)), 0)
    assert other.written == 2
    assert query(pg, "SELECT count(*), count(DISTINCT _isb_id) FROM once") == [(17, 17)]


def test_a_failed_transaction_leaves_nothing_behind(pg):
    """The rows and the bookkeeping row land together or not at all: the bookkeeping insert,
    the last statement, is made to fail after the rows went into the target."""
    t = target(pg, "atomic_s.atomic")
    commit_batch(t, batch(range(1, 4)), 0)
    query(pg, "ALTER TABLE atomic_s.isb_sink_batches ADD CONSTRAINT at_most_3 CHECK (rows <= 3)")
    with pytest.raises(PostgresSinkError) as e:
        commit_batch(t, batch(range(4, 8)), 1)
    text = str(e.value)
    assert text.startswith("postgres sink 'raw' (table atomic_s.atomic, connection 'pg_sinks'): batch 1 "
                           "not committed:") and "at_most_3" in text, text
    assert query(pg, "SELECT count(*) FROM atomic_s.atomic") == [(3,)]
    assert query(pg, "SELECT batch_id FROM atomic_s.isb_sink_batches") == [(0,)]
    query(pg, "ALTER TABLE atomic_s.isb_sink_batches DROP CONSTRAINT at_most_3")
    assert commit_batch(t, batch(range(4, 8)), 1).written == 4  # the retry commits it whole
    # a column the table lacks: refused before anything is written, naming the columns
    bad = batch(range(8, 10)).append_column("extra", pa.array([1, 2], pa.int64()))
    with pytest.raises(PostgresSinkError, match=r"the batch's columns \['extra'\] are not in the table"):
        commit_batch(t, bad, 2)
    assert query(pg, "SELECT count(*) FROM atomic_s.atomic") == [(7,)]


def test_upsert_keeps_the_latest_version_of_each_key(pg):
    t = target(pg, "agg", app="p/agg", mode="upsert", key=("service", "minute"), version_column="_isb_version")
    first = pa.table({"service": ["a", "a", "b"], "minute": [1, 1, 1], "count": [1, 2, 5],
                      "_isb_version": [10, 11, 10]})
    assert commit_batch(t, first, 0).written == 2
    assert query(pg, "SELECT service, minute, count FROM agg ORDER BY service") == [("a", 1, 2), ("b", 1, 5)]
    assert [c for (c,) in query(pg, "SELECT column_name FROM information_schema.columns "
                                    "WHERE table_name = 'agg' ORDER BY ordinal_position")] == \
        ["service", "minute", "count"]  # the version column is wire metadata, not a sink column
    second = pa.table({"service": ["a", "c"], "minute": [1, 1], "count": [7, 1], "_isb_version": [12, 12]})
    assert commit_batch(t, second, 1).written == 2
    assert commit_batch(t, second, 1).written == 0  # replayed
    assert query(pg, "SELECT service, count FROM agg ORDER BY service") == [("a", 7), ("b", 5), ("c", 1)]


def test_a_schema_qualified_table_gets_its_schema_and_bookkeeping(pg):
    commit_batch(target(pg, "landing.events"), batch(range(1, 3)), 0)
    assert query(pg, "SELECT count(*) FROM landing.events") == [(2,)]
    assert query(pg, "SELECT count(*) FROM landing.isb_sink_batches") == [(1,)]


def test_a_dsn_with_a_password_file(pg, tmp_path, monkeypatch):
    monkeypatch.delenv(SECRETS_ENV, raising=False)
    (tmp_path / "secrets").mkdir()
    pw = tmp_path / "secrets" / "pw"
    pw.write_text(pg.password + "\n")
    pw.chmod(0o644)
    spec = PostgresSink(table="by_dsn", dsn=f"host={HOST} port={pg.port} dbname={pg.db} user={pg.user}",
                        passwordFile="secrets/pw")
    t = PostgresTarget(sink="raw", spec=spec, app_id="p/raw", data_dir=str(tmp_path), environ={})
    with pytest.raises(PostgresSinkError, match=r"passwordFile .*/pw is readable by others \(mode 644\): chmod 600"):
        commit_batch(t, batch(range(1, 4)), 0)
    pw.chmod(0o600)
    assert commit_batch(t, batch(range(1, 4)), 0).written == 3
    # or from an environment variable
    spec = PostgresSink(table="by_dsn", dsn=f"postgresql://{pg.user}@{HOST}:{pg.port}/{pg.db}", passwordEnv="PGPW")
    t = PostgresTarget(sink="raw", spec=spec, app_id="p/raw", environ={"PGPW": pg.password})
    assert commit_batch(t, batch(range(3, 6)), 1).written == 2


def test_a_column_without_a_postgresql_type_is_named(pg):
    odd = batch(range(1, 3)).append_column("nothing", pa.nulls(2))
    with pytest.raises(PostgresSinkError, match="column 'nothing': no PostgreSQL type for Arrow type null; cast it"):
        commit_batch(target(pg, "odd"), odd, 0)


def test_a_bad_connection_names_the_sink_and_the_connection_never_the_password(pg):
    wrong = "wrong-Pa55word"
    t = PostgresTarget(sink="raw", spec=PostgresSink(table="x", connection="pg_sinks"), app_id="p/raw",
                       environ=conn_env(pg, password=wrong))
    with pytest.raises(PostgresSinkError) as e:
        connect(t)
    text = str(e.value)
    assert text.startswith("postgres sink 'raw' (table x, connection 'pg_sinks'): cannot connect:"), text
    assert "password authentication failed" in text and wrong not in text and pg.password not in text
    # a connection id the environment does not define
    t = PostgresTarget(sink="raw", spec=PostgresSink(table="x", connection="nope"), app_id="p/raw", environ={})
    with pytest.raises(PostgresSinkError, match="Airflow connection 'nope' is not defined: set AIRFLOW_CONN_NOPE"):
        connect(t)
    # nothing listening
    t = PostgresTarget(sink="raw", spec=PostgresSink(table="x", connection="pg_sinks"), app_id="p/raw",
                       environ={"AIRFLOW_CONN_PG_SINKS": f"postgres://isb:{wrong}@{HOST}:1/sinks"})
    with pytest.raises(PostgresSinkError) as e:
        connect(t)
    assert "connection 'pg_sinks'" in str(e.value) and wrong not in str(e.value)


def test_airflow_connection_forms():
    uri = {"AIRFLOW_CONN_PG": "postgres://u%40x:p%2Fw@db.example:6543/warehouse?sslmode=require&foo=1"}
    assert airflow_connection("pg", uri) == {"host": "db.example", "port": 6543, "user": "u@x", "password": "p/w",
                                             "dbname": "warehouse", "sslmode": "require"}
    js = {"AIRFLOW_CONN_MY_PG": json.dumps({"conn_type": "postgres", "host": "h", "login": "u", "password": "pw",
                                            "schema": "d", "port": 5432, "extra": {"sslmode": "disable"}})}
    assert airflow_connection("my-pg", js) == {"host": "h", "port": 5432, "user": "u", "password": "pw",
                                               "dbname": "d", "sslmode": "disable"}
    with pytest.raises(PostgresSinkError, match="'pg' \\(AIRFLOW_CONN_PG\\) is a connection of type 'mysql', not postgres"):
        airflow_connection("pg", {"AIRFLOW_CONN_PG": "mysql://u:p@h/d"})


def test_a_connection_of_another_type_is_refused_whatever_its_form():
    """A spec's connection must not take the ISB admin's (nats_default, Airflow's JSON form) or any
    other service's credentials to a host of its choosing."""
    nats = json.dumps({"conn_type": "nats", "host": "127.0.0.1:4222", "login": "isbflow", "password": "admin-pw"})
    for value in (nats, json.dumps({"host": "h", "login": "u", "password": "p"}), "aws://key:secret@"):
        with pytest.raises(PostgresSinkError, match=r"sink.postgres.connection 'nats_default' "
                           r"\(AIRFLOW_CONN_NATS_DEFAULT\) is a connection of type '\w+', not postgres") as e:
            connect_kwargs(PostgresTarget(sink="raw", spec=PostgresSink(table="t", connection="nats_default"),
                                          app_id="p/raw", environ={"AIRFLOW_CONN_NATS_DEFAULT": value}))
        assert "postgres sink 'raw'" in str(e.value) and "admin-pw" not in str(e.value)


def test_a_password_file_is_read_only_from_the_secrets_folder(tmp_path, monkeypatch):
    """passwordFile must not send an owner-only file of this host (the ISB admin's password, a key)
    to the server the spec names: only files in the secrets folder, symlinks resolved."""
    monkeypatch.delenv(SECRETS_ENV, raising=False)
    data = tmp_path / "data"
    (data / "nats").mkdir(parents=True)
    (data / "secrets").mkdir()
    admin = data / "nats" / "password"
    admin.write_text("admin-pw\n")
    admin.chmod(0o600)
    (data / "secrets" / "pg").write_text("pg-pw\n")
    (data / "secrets" / "pg").chmod(0o600)
    (data / "secrets" / "link").symlink_to(admin)

    def password(path: str, where: Path = data) -> object:
        spec = PostgresSink(table="t", dsn="host=db.example user=u", passwordFile=path)
        return connect_kwargs(PostgresTarget(sink="raw", spec=spec, app_id="p/raw", data_dir=str(where),
                                             environ={}))["password"]

    assert password("secrets/pg") == password(str(data / "secrets" / "pg")) == "pg-pw"
    for path in (str(admin), "nats/password", "secrets/link", "secrets/../nats/password"):
        with pytest.raises(PostgresSinkError, match=rf"postgres sink 'raw' .*: sink.postgres.passwordFile "
                           rf"'{re.escape(path)}' is outside the secrets folder {re.escape(str(data / 'secrets'))}"):
            password(path)
    monkeypatch.setenv(SECRETS_ENV, str(data / "nats"))  # a configured folder
    assert password(str(admin)) == "admin-pw"


def edge_values(nested: bool) -> pa.Table:
    """Values COPY must not bend: NULL vs '', quotes, commas and newlines, NaN, both timestamps."""
    t = pa.table({
        "s": pa.array(["a", None, "", 'q"x,y\nz'], pa.string()),
        "i": pa.array([1, None, 3, -(2**40)], pa.int64()),
        "f": pa.array([1.5, float("nan"), None, 1e-20], pa.float64()),
        "b": pa.array([True, None, False, True]),
        "ts": pa.array([dt.datetime(2026, 1, 1, 1, 2, 3, 456789, tzinfo=dt.UTC), None, None, None],
                       pa.timestamp("us", tz="UTC")),
        "local": pa.array([dt.datetime(2026, 1, 1, 1, 2, 3), None, None, None], pa.timestamp("us")),
        "d": pa.array([dt.date(2026, 3, 1), None, None, None], pa.date32()),
        "dec": pa.array([Decimal("1.25"), None, Decimal("-0.01"), None], pa.decimal128(10, 2)),
        "_isb_id": pa.array([f"in/0/{n}" for n in range(1, 5)]),
    })
    return t.append_column("l", pa.array([[1], None, [], [2, 3]], pa.list_(pa.int64()))) if nested else t


@pytest.mark.parametrize("nested", [False, True], ids=["csv-copy", "row-copy"])
def test_values_survive_the_copy_and_read_back_as_written(pg, nested):
    """Flat batches go through Arrow's CSV writer, batches with nested columns row by row: both
    land the same values, and the quality reader (pg_read) gives them back."""
    t = target(pg, f"edges_{'nested' if nested else 'flat'}")
    written = edge_values(nested)
    assert commit_batch(t, written, 0).written == 4
    snap = read_snapshot(t)
    got = snap.rows.sort_by("_isb_id")
    assert snap.batches == 1 and snap.held == {"in/0": [[1, 4]]} == snap.last_offsets
    for name in ("s", "i", "b", "ts", "local", "d", "dec", "_isb_id"):
        assert got.column(name).to_pylist() == written.column(name).to_pylist(), name
    f = got.column("f").to_pylist()
    assert f[0] == 1.5 and math.isnan(f[1]) and f[2] is None and f[3] == 1e-20
    if nested:
        assert [None if v is None else json.loads(v) for v in got.column("l").to_pylist()] == [[1], None, [], [2, 3]]


def test_rows_refused_one_by_one_are_handed_over_and_the_rest_commits(pg):
    """A CHECK constraint and a value too long for its column refuse 2 rows of 39: bisecting under
    savepoints finds exactly them, with the server's reasons, and the other 37 commit with the
    bookkeeping row, in one transaction; the replayed batch commits nothing and refuses nothing."""
    t = target(pg, "refusing")
    commit_batch(t, batch([1]), 0)
    query(pg, "ALTER TABLE refusing ADD CONSTRAINT n_not_13 CHECK (n <> 13)")
    query(pg, "ALTER TABLE refusing ALTER COLUMN msg TYPE varchar(3)")  # 'm100' does not fit, 'm99' does
    got: list = []
    rows = batch([*range(2, 13), *range(14, 40), 100, 13])
    out = commit_batch(t, rows, 1, on_refused=lambda r, why: got.append((r, why)))
    ((refused, reasons),) = got
    assert sorted(refused.column("n").to_pylist()) == [13, 100] and refused.column("_isb_id").to_pylist() \
        == [f"in/0/{n}" for n in refused.column("n").to_pylist()]
    why = dict(zip(refused.column("n").to_pylist(), reasons, strict=True))
    assert "n_not_13" in why[13] and "23514" in why[13], why
    assert "character varying(3)" in why[100] and "22001" in why[100], why
    assert (out.rows, out.written, out.refused) == (39, 37, 2)
    assert query(pg, "SELECT count(*) FROM refusing") == [(38,)]
    assert query(pg, "SELECT batch_id, rows, written FROM isb_sink_batches WHERE target = 'refusing' "
                     "ORDER BY batch_id") == [(0, 1, 1), (1, 39, 37)]
    again = commit_batch(t, rows, 1, on_refused=lambda r, why: got.append((r, why)))
    assert again.written == 0 and again.skipped_reason and len(got) == 1
    # without on_refused, a refused row fails the whole batch, naming it; nothing is written
    with pytest.raises(PostgresSinkError, match=r"refused 1 row\(s\), the first \(row 1\): .*n_not_13"):
        commit_batch(t, batch([50, 13, 51]), 2)
    assert query(pg, "SELECT count(*) FROM refusing WHERE n >= 50") == [(0,)]
    # an error that is not a row's (a missing column) is not bisected: the batch fails as before
    query(pg, "ALTER TABLE refusing DROP COLUMN msg")
    with pytest.raises(PostgresSinkError, match="not in the table"):
        commit_batch(t, batch([60]), 3, on_refused=lambda r, why: got.append((r, why)))
    assert len(got) == 1


def test_fallback_tables_hold_a_batch_once_and_say_which_ids(pg, tmp_path):
    """Both fallback kinds: a batch's rows with the reason columns, committed once per (app id,
    batch id); held() names the ids of a batch it took, None for one it did not."""
    from deltalake import DeltaTable

    from isbflow.sinks.fallback import DeltaFallback, PostgresFallback, with_reasons

    rows = with_reasons(batch(range(1, 4)), "down", 3, "p/raw", 7)
    assert rows.schema.names[-4:] == ["_isb_error", "_isb_attempts", "_isb_app", "_isb_batch"]
    for fb in (PostgresFallback(target(pg, "fb.failed")), DeltaFallback(str(tmp_path / "failed"), "p/raw")):
        assert fb.held(7) is None
        assert fb.commit(rows, 7) is True
        assert fb.commit(rows, 7) is False  # a replay commits nothing
        assert sorted(fb.held(7)) == ["in/0/1", "in/0/2", "in/0/3"] and fb.held(8) is None
    assert query(pg, "SELECT count(*), min(_isb_error), min(_isb_attempts), min(_isb_batch) FROM fb.failed") \
        == [(3, "down", 3, 7)]
    assert DeltaTable(str(tmp_path / "failed")).to_pyarrow_dataset().count_rows() == 3
