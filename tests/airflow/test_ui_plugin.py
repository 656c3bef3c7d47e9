"""The Airflow UI plugin: pages, JSON, auth and report paths, against real NATS and real Airflow.

The app under test is Airflow's own api-server app (``create_app("core")``) with this
repository's ``plugins/`` folder, so the plugin is mounted by Airflow's plugins manager
and ``/auth/token`` is Airflow's. It runs behind starlette's ``TestClient`` in a child
process (:class:`UiChild`) that has the test's ``AIRFLOW_HOME``: Airflow reads its
configuration once per process at import, and the pytest process never imports it
(the rule of ``tests/helpers/airflow_env.py``). The child answers one JSON request per line.

Status is written to a real nats-server through :mod:`isbflow.isb.state`; quality
reports through :func:`isbflow.quality.reports.save_report`; the last drain and replay
are real DAG runs (``dag.test()``) in the module's own metadata DB, which starts empty
so "none" is what it shows before them.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import pytest

from isbflow.isb import naming, provision
from isbflow.isb import state as st
from isbflow.isb.connect import connect
from isbflow.isb.server import start_embedded, stop_embedded
from isbflow.platform import airflow_env, nats_connection_json
from isbflow.quality import reports
from isbflow.quality.checks import CheckResult
from isbflow.quality.run import QualityReport
from isbflow.spec import load_specs
from tests.helpers.airflow_env import (  # noqa: F401
    DAGS,
    ROOT,
    AirflowHome,
    airflow_home_from,
)

pytestmark = pytest.mark.slow

MARK = "@@UI@@ "
PIPELINE = "demo"
SECRET = "top-secret-outside-the-reports-folder"
PLUGINS = ROOT / "plugins"

SPEC = """\
apiVersion: isbflow.io/v1alpha1
kind: InterStepBufferService
metadata: {name: default}
spec:
  jetstream:
    url: embedded
    bufferConfig:
      stream: {retention: Limits, maxBytes: 16MiB, storage: file, replicas: 1}
---
apiVersion: isbflow.io/v1alpha1
kind: Pipeline
metadata: {name: demo}
spec:
  interStepBufferServiceName: default
  vertices:
    - name: in
      source:
        jetstream: {subject: demo.events}
        schema: "service STRING, n INT"
    - name: parse
      partitions: 2
      udf: {transform: "spark_apps.logs:parse"}
    - name: raw
      sink:
        delta: {path: sinks/demo/raw}
  edges:
    - {from: in, to: parse, partitionKey: service}
    - {from: parse, to: raw}
"""
BROKEN = SPEC.replace("partitions: 2", "partitions: 0")



# ------------------------------------------------------------------ fixtures


@dataclass
class Resp:
    status: int
    headers: dict[str, str]
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


class UiChild:
    """A child process holding Airflow's api-server app behind TestClient (module docstring)."""

    def __init__(self, env: dict[str, str], log: Path):
        self.log = log
        self._logf = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, __file__], env=env, cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._logf)

    def call(self, **req: Any) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARK):
                out = json.loads(line[len(MARK):])
                if "error" in out:
                    raise AssertionError(f"UI child failed on {req}: {out['error']}")
                return out
        raise AssertionError(f"UI child exited ({self.proc.poll()}):\n{self.log.read_text()[-4000:]}")

    def get(self, path: str, auth: str = "bearer", raw: bool = False) -> Resp:
        out = self.call(op="raw" if raw else "get", path=path, auth=auth)
        return Resp(out["status"], out["headers"], out["text"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._logf.close()


@pytest.fixture(scope="module")
def ui_nats(tmp_path_factory):
    """A nats-server for the module (the per-test ``nats_server`` would need one UI child per test)."""
    data_dir = tmp_path_factory.mktemp("ui-nats")
    state = start_embedded(data_dir, cluster=1)
    try:
        yield state
    finally:
        stop_embedded(data_dir)


@pytest.fixture(scope="module")
def site(tmp_path_factory, ui_nats, migrated_airflow_db):
    """Spec folder (demo.yaml, broken.yaml), isbflow data dir, provisioned buffers, a migrated Airflow."""
    root = tmp_path_factory.mktemp("ui-site")
    specs_dir = root / "pipelines"
    specs_dir.mkdir()
    (specs_dir / "demo.yaml").write_text(SPEC)
    (specs_dir / "broken.yaml").write_text(BROKEN)
    data_dir = root / "data"
    data_dir.mkdir()
    (data_dir / "secret.txt").write_text(SECRET)
    specs = load_specs([specs_dir / "demo.yaml"])
    settings = _settings(ui_nats)
    asyncio.run(provision.apply(settings, specs))

    home = root / "airflow"
    env = airflow_home_from(migrated_airflow_db, home)  # the session's one migration, copied
    env.update({
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS),
        "ISBFLOW_PIPELINES_DIR": str(specs_dir),
        "ISBFLOW_HOME": str(data_dir),
        "NATS_URL": "",
        "AIRFLOW_CONN_NATS_DEFAULT": nats_connection_json(ui_nats),
    })
    return Site(root, specs_dir, data_dir, settings, AirflowHome(home, env))


@dataclass
class Site:
    root: Path
    specs_dir: Path
    data_dir: Path
    settings: Any
    airflow: AirflowHome


@pytest.fixture(scope="module")
def ui(site, tmp_path_factory):
    child = UiChild(site.airflow.env, tmp_path_factory.mktemp("ui-child") / "child.log")
    try:
        yield child
    finally:
        child.close()


def _settings(state):
    from isbflow.isb.connect import NatsSettings

    return NatsSettings(servers=tuple(state.urls), user=state.user, password=state.password, tls_ca=state.ca_file)


# ------------------------------------------------------------------ HTML helpers


class _Elements(HTMLParser):
    """Every element as (tag, attrs, text inside it), enough to find ``[data-*]`` things."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str], list[str]]] = []
        self._open: list[tuple[str, dict[str, str], list[str]]] = []

    VOID = {"meta", "br", "img", "input", "link", "hr", "polyline", "path", "circle", "rect", "line"}

    def handle_starttag(self, tag, attrs):
        el = (tag, {k: v or "" for k, v in attrs}, [])
        self.found.append(el)
        if tag not in self.VOID:
            self._open.append(el)

    def handle_startendtag(self, tag, attrs):
        self.found.append((tag, {k: v or "" for k, v in attrs}, []))

    def handle_endtag(self, tag):
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == tag:
                del self._open[i:]
                break

    def handle_data(self, data):
        for el in self._open:
            el[2].append(data)


def find(html: str, attr: str, value: str | None = None, tag: str | None = None) -> list[tuple[str, dict, str]]:
    """Elements having ``attr`` (equal to ``value`` when given): (tag, attrs, text)."""
    p = _Elements()
    p.feed(html)
    return [(t, a, " ".join("".join(txt).split())) for t, a, txt in p.found
            if attr in a and (value is None or a[attr] == value) and (tag is None or t == tag)]


def one(html: str, attr: str, value: str | None = None, tag: str | None = None) -> tuple[str, dict, str]:
    els = find(html, attr, value, tag)
    assert len(els) == 1, f"expected one element [{attr}={value}], found {len(els)}"
    return els[0]


def inner(html: str, attr: str, value: str) -> str:
    """The HTML between the start tag carrying ``attr="value"`` and its section/tr end."""
    m = re.search(rf'<(\w+)[^>]*\b{attr}="{re.escape(value)}"[^>]*>(.*?)</\1>', html, re.S)
    assert m, f'no element with {attr}="{value}"'
    return m.group(2)


# ------------------------------------------------------------------ writing state


async def _write_status(settings) -> float:
    """Heartbeats of in, parse (with rate history) and raw (stale); 3 dead letters."""
    nc = await connect(settings)
    try:
        now = time.time()
        base = math.floor(now / 60) * 60
        kv = await nc.jetstream().key_value(naming.status_bucket(PIPELINE))
        await kv.purge(st.rates_key("parse"))  # the same history however often this runs
        parse = st.StepStatus("parse", state=st.Observed.RUNNING, batch_id=4)
        for t, rin, rout, rows in [(base - 7200 + 5, 9.0, 9.0, 10),  # older than an hour: dropped
                                   (base - 3000 + 5, 100.0, 200.0, 1000),
                                   (base - 1800 + 5, 300.0, 400.0, 2000),
                                   (base - 1800 + 15, 500.0, 600.0, 3000),  # same minute: the mean
                                   (base - 300 + 5, 700.0, 800.0, 3000)]:  # rows unchanged: idle, 0
            parse.input_rows_per_s, parse.processed_rows_per_s, parse.rows_total = rin, rout, rows
            await st.record_rates(nc, PIPELINE, parse, now=t)
        parse.input_rows_per_s, parse.processed_rows_per_s, parse.rows_total = 1234.5, 2345.5, 3000
        parse.lag = {"isb-demo-in-parse-0": 3, "isb-demo-in-parse-1": 4}
        parse.dlq_total = 2
        await st.put_status(nc, PIPELINE, parse)
        await st.put_status(nc, PIPELINE, st.StepStatus("in", state=st.Observed.RUNNING, batch_id=9,
                                                         input_rows_per_s=1000.0, processed_rows_per_s=2000.0,
                                                         rows_total=5000, lag={"src-demo-in": 7}))
        await st.set_desired(nc, PIPELINE, "parse", st.Desired.DRAINING)
        # put_status stamps the time; a stale heartbeat is written as the runner's would have been
        raw = st.StepStatus("raw", state=st.Observed.RUNNING, batch_id=2, updated_at=now - 120,
                            lag={"isb-demo-parse-raw-0": 11}, sink_retries=4, fallback_total=21, dropped_total=0,
                            sink_error="batch 2, attempt 4: cannot connect")
        await kv.put("step.raw", json.dumps(raw.to_json()).encode())
        js = nc.jetstream()
        await js.purge_stream(naming.dlq_stream(PIPELINE))
        for i in range(3):
            await js.publish(naming.dlq_subject(PIPELINE, "parse"), f"bad {i}".encode())
        return base
    finally:
        await nc.close()


def _report(run_id: str, sink: str, failures: list[CheckResult], time_: datetime) -> dict:
    ok = CheckResult("schema", True)
    r = QualityReport(run_id=run_id, pipeline=PIPELINE, sink=sink, kind="raw", table_path="/x", table_version=3,
                      rows=100, time=time_.isoformat(), gate="fail", success=not failures,
                      checks=[ok, *failures], docs=f"{run_id}.html")
    return r.to_dict()


def _write_reports(data_dir: Path) -> dict[str, str]:
    """Three raw runs (pass, fail, pass) and one agg run; each with a Data Docs page."""
    t0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    ids = {}
    for name, sink, minutes, failures in [
        ("old-pass", "raw", 0, []),
        ("fail", "raw", 10, [CheckResult("expect_column_values_to_not_be_null", False, unexpected_count=17,
                                         origin="spec", kwargs={"column": "service"}),
                             CheckResult("uniqueness", False, unexpected_count=5)]),
        ("new-pass", "raw", 20, []),
        ("agg-pass", "agg", 5, []),
    ]:
        when = t0 + timedelta(minutes=minutes)
        run_id = reports.new_run_id(when)
        ids[name] = run_id
        html = (f'<html><head><link rel="stylesheet" href="../../_static/isbflow-docs.css"></head>'
                f'<body><h1 id="docs">Data Docs {run_id}</h1></body></html>')
        reports.save_report(data_dir, _report(run_id, sink, failures, when), html)
    static = reports.reports_root(data_dir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / "isbflow-docs.css").write_text("body { color: black; }")
    (static / ".hidden.css").write_text("hidden")
    (reports.reports_root(data_dir) / PIPELINE / "raw" / "escape.json").symlink_to(data_dir / "secret.txt")
    return ids


def _run_stand_in(ui: UiChild, dag_id: str, conf: dict) -> str:
    """Run a one-task DAG named ``dag_id`` with ``dag.test()`` (in the UI child, which has
    Airflow loaded and the module's metadata DB); return its run id."""
    out = ui.call(op="dagtest", dag_id=dag_id, conf=conf)
    assert out["state"] == "success", out
    return out["run_id"]


# ------------------------------------------------------------------ tests


PAGES = ["/isbflow/pipelines", "/isbflow/api/pipelines", "/isbflow/quality", "/isbflow/api/quality",
         "/isbflow/", "/isbflow/reports/demo/raw/{run}.json", "/isbflow/reports/demo/raw/{run}.html",
         "/isbflow/reports/_static/isbflow-docs.css"]


def test_every_route_refuses_a_caller_without_a_valid_token(ui, site):
    asyncio.run(_write_status(site.settings))
    run = _existing_ids(site.data_dir)["fail"]
    for path in [p.format(run=run) for p in PAGES]:
        for auth in ("none", "garbage", "garbage-cookie", "expired", "forged"):
            r = ui.get(path, auth=auth)
            assert r.status == 401, (path, auth, r.status, r.text[:300])
            body = re.sub(r'next=[^"]*', "", r.text)  # the login link names the page asked for
            for leak in ("parse", run, "2345.5", "expect_column_values", "Data Docs", "color: black"):
                assert leak not in body, (path, auth, leak)
            if "/api/" in path:
                assert r.headers["content-type"] == "application/json"
                assert r.json()["detail"]
            else:
                assert r.headers["content-type"].startswith("text/html")
                login = one(r.text, "id", "login", tag="a")[1]["href"]
                assert login.startswith("/auth/login?next="), login
    # a valid user the auth manager does not let read DAGs: 403, no data either
    for path in ("/isbflow/api/pipelines", "/isbflow/pipelines"):
        r = ui.get(path, auth="norole")
        assert r.status == 403 and "parse" not in r.text and "may not read DAGs" in r.text
    # the same paths with a token: the bearer from POST /auth/token, the UI's cookie, a minted JWT
    for auth in ("bearer", "cookie", "minted"):
        r = ui.get("/isbflow/api/pipelines", auth=auth)
        assert r.status == 200, (auth, r.text[:300])
        assert [s["vertex"] for s in r.json()["pipelines"][1]["steps"]] == ["in", "parse", "raw"]


def test_pipelines_json_and_page_show_real_status(ui, site):
    base = asyncio.run(_write_status(site.settings))
    data = ui.get("/isbflow/api/pipelines").json()
    assert data["pipelines_dir"] == str(site.specs_dir)
    assert data["nats_error"] is None and data["runs_error"] is None
    broken, demo = data["pipelines"]
    assert broken["file"] == "broken.yaml" and broken["name"] is None
    assert "vertices[1].partitions: must be >= 1" in broken["error"]
    assert demo["file"] == "demo.yaml" and demo["name"] == PIPELINE and demo["nats_error"] is None
    steps = {s["vertex"]: s for s in demo["steps"]}
    assert [s["vertex"] for s in demo["steps"]] == ["in", "parse", "raw"]
    assert (steps["in"]["state"], steps["in"]["stale"], steps["in"]["lag_total"]) == ("running", False, 7)
    assert steps["parse"]["desired"] == "draining" and steps["in"]["desired"] == "running"
    assert (steps["parse"]["input_rows_per_s"], steps["parse"]["processed_rows_per_s"]) == (1234.5, 2345.5)
    assert (steps["parse"]["dlq_total"], steps["parse"]["batch_id"], steps["parse"]["lag_total"]) == (2, 4, 7)
    assert steps["raw"]["stale"] is True and steps["raw"]["heartbeat_age_s"] >= 120
    assert steps["parse"]["heartbeat_age_s"] < 60
    assert [(p["t"], p["input_rows_per_s"], p["processed_rows_per_s"]) for p in steps["parse"]["rates"]] == [
        (base - 3000, 100.0, 200.0), (base - 1800, 400.0, 500.0), (base - 300, 0.0, 0.0)]
    assert steps["in"]["rates"] == [] and steps["raw"]["rates"] == []
    lags = {(e["from_vertex"], e["to_vertex"], p["partition"]): p["lag"] for e in demo["edges"] for p in e["partitions"]}
    assert lags == {("in", "parse", 0): 3, ("in", "parse", 1): 4, ("parse", "raw", 0): 11}
    assert demo["edges"][0]["partition_key"] == "service"
    assert (demo["dlq_stream"], demo["dlq_messages"]) == ("isb-demo-dlq", 3)
    assert demo["last_drain"] is None and demo["last_replay"] is None

    r = ui.get("/isbflow/pipelines")
    assert r.status == 200 and r.headers["cache-control"] == "no-store"
    html = r.text
    one(html, "id", "pipelines", tag="main")
    sec = one(html, "data-pipeline", PIPELINE, tag="section")[1]
    assert sec["data-file"] == "demo.yaml"
    rows = {a["data-step"]: a for _, a, _ in find(html, "data-step", tag="tr")}
    assert {v: (a["data-state"], a["data-stale"]) for v, a in rows.items()} == {
        "in": ("running", "false"), "parse": ("running", "false"), "raw": ("running", "true")}
    parse_row = inner(html, "data-step", "parse")
    assert [t for _, _, t in find(parse_row, "data-rate")] == ["1234.5", "2345.5"]
    assert one(parse_row, "data-dlq")[2] == "2" and one(parse_row, "data-lag")[2] == "7"
    # a sink's failure policy: retries / fallback / dropped, and the failure while attempts go on
    raw_row = inner(html, "data-step", "raw")
    assert one(raw_row, "data-sink")[2] == "4 / 21 / 0" and one(parse_row, "data-sink")[2] == ""
    assert "retrying: <span>batch 2, attempt 4: cannot connect</span>" in raw_row
    assert (steps["raw"]["sink_retries"], steps["raw"]["fallback_total"]) == (4, 21)
    assert [a["data-lag"] for _, a, _ in find(html, "data-lag", tag="td") if "data-stream" not in a][-3:] == [
        "3", "4", "11"]
    assert one(html, "data-dlq-messages")[1]["data-dlq-messages"] == "3"
    assert "vertices[1].partitions: must be &gt;= 1" in html
    for kind in ("drain", "replay"):
        assert one(html, "data-last", kind)[2] == "none"
    lines = {a["data-step"]: a["points"] for _, a, _ in find(html, "data-step", tag="polyline")}
    assert len(lines["parse"].split()) == 3 and lines["in"] == "" and lines["raw"] == ""
    # no outside resources; the inline script carries the CSP nonce
    assert not re.search(r"(src|href)=\"(https?:)?//", html)
    nonce = re.search(r"script-src 'nonce-([^']+)'", r.headers["content-security-policy"]).group(1)
    assert f'<script nonce="{nonce}">' in html


def test_last_drain_and_replay_link_to_their_dag_runs(ui, site):
    drain = _run_stand_in(ui, "pipeline_drain", {"pipeline": "demo.yaml", "timeout": 60})
    replay = _run_stand_in(ui, "pipeline_replay", {"pipeline": "other.yaml"})  # another spec: not demo's
    demo = ui.get("/isbflow/api/pipelines").json()["pipelines"][1]
    assert demo["last_drain"]["run_id"] == drain and demo["last_drain"]["state"] == "success"
    assert demo["last_replay"] is None
    replay = _run_stand_in(ui, "pipeline_replay", {"pipeline": "demo.yaml"})
    html = ui.get("/isbflow/pipelines").text
    for kind, dag_id, run_id in (("drain", "pipeline_drain", drain), ("replay", "pipeline_replay", replay)):
        links = find(inner(html, "data-last", kind), "href", tag="a")
        assert len(links) == 1
        href = links[0][1]["href"]
        assert href.startswith(f"/dags/{dag_id}/runs/") and unquote(href.rsplit("/", 1)[1]) == run_id
        assert links[0][2] == run_id
    # as the DAG's tab: that DAG's latest run on top
    tab = ui.get("/isbflow/pipelines?dag_id=pipeline_drain").text
    ctx = inner(tab, "id", "dag-context")
    assert drain in ctx and "demo.yaml" in ctx and "pipeline_drain" in ctx
    assert ui.get("/isbflow/api/pipelines?dag_id=pipeline_replay").json()["dag_run"]["run_id"] == replay


def test_the_last_recovery_shows_on_the_pipelines_page(ui, site):
    """What recover keeps in the status bucket: none shown before, then its state and phases."""
    async def put(value: bytes | None) -> None:
        nc = await connect(site.settings)
        try:
            kv = await nc.jetstream().key_value(naming.status_bucket(PIPELINE))
            if value is None:
                await kv.purge("recovery")
            else:
                await kv.put("recovery", value)
        finally:
            await nc.close()

    asyncio.run(_write_status(site.settings))
    asyncio.run(put(None))
    demo = ui.get("/isbflow/api/pipelines").json()["pipelines"][1]
    assert demo["recovery"] is None and demo["recovery_state"] is None
    report = {"state": "failed", "updated_at": time.time(), "lost": [{"stream": "isb-demo-parse-raw-0"}],
              "phases": [{"name": "detect", "state": "done", "seconds": 0.1},
                         {"name": "replay", "state": "failed", "seconds": 2.0}]}
    asyncio.run(put(json.dumps(report).encode()))
    try:
        demo = ui.get("/isbflow/api/pipelines").json()["pipelines"][1]
        assert demo["recovery_state"] == "failed"
        assert demo["recovery"].startswith("last recovery: failed") and "lost: isb-demo-parse-raw-0" in demo["recovery"]
        html = ui.get("/isbflow/pipelines").text
        shown = one(html, "data-recovery", "failed", tag="p")
        assert "replay failed 2.0s" in shown[2] and "bad" in shown[1]["class"]
    finally:
        asyncio.run(put(None))


def test_quality_page_lists_runs_per_sink_and_serves_reports(ui, site):
    ids = {**_existing_ids(site.data_dir)}
    data = ui.get("/isbflow/api/quality").json()
    by_sink = {(s["pipeline"], s["sink"]): s["runs"] for s in data["sinks"]}
    assert list(by_sink) == [(PIPELINE, "agg"), (PIPELINE, "raw")]
    raw = by_sink[(PIPELINE, "raw")]
    assert [r["run_id"] for r in raw] == [ids["new-pass"], ids["fail"], ids["old-pass"]]
    assert [r["success"] for r in raw] == [True, False, True]
    assert [(f["name"], f["unexpected_count"]) for f in raw[1]["failures"]] == [
        ("expect_column_values_to_not_be_null", 17), ("uniqueness", 5)]

    html = ui.get("/isbflow/quality").text
    one(html, "id", "quality", tag="main")
    rows = [(a["data-run"], a["data-result"]) for _, a, _ in find(html, "data-run", tag="tr")]
    assert rows == [(ids["agg-pass"], "pass"), (ids["new-pass"], "pass"), (ids["fail"], "fail"),
                    (ids["old-pass"], "pass")]
    failed = inner(html, "data-run", ids["fail"])
    assert [(a["data-check"], a["data-unexpected"]) for _, a, _ in find(failed, "data-check")] == [
        ("expect_column_values_to_not_be_null", "17"), ("uniqueness", "5")]
    href = one(failed, "class", "report", tag="a")[1]["href"]
    assert href == f"/isbflow/reports/{PIPELINE}/raw/{ids['fail']}.html"
    docs = ui.get(href)
    assert docs.status == 200 and docs.headers["content-type"].startswith("text/html")
    assert f"Data Docs {ids['fail']}" in docs.text
    csp = docs.headers["content-security-policy"]
    assert "script-src 'none'" in csp
    assert all(d in csp for d in ("sandbox", "form-action 'none'", "base-uri 'none'")), csp
    # the page's relative stylesheet resolves to the served static folder
    css_href = one(docs.text, "rel", "stylesheet", tag="link")[1]["href"]
    css = ui.get(urlsplit(urljoin(f"http://testserver{href}", css_href)).path)
    assert css.status == 200 and css.text == "body { color: black; }"
    js = ui.get(one(failed, "class", "report-json", tag="a")[1]["href"])
    assert js.status == 200 and js.json()["run_id"] == ids["fail"] and js.json()["failures"][0]["unexpected_count"] == 17
    only_agg = ui.get(f"/isbflow/api/quality?pipeline={PIPELINE}&sink=agg").json()["sinks"]
    assert [(s["sink"], len(s["runs"])) for s in only_agg] == [("agg", 1)]


def _existing_ids(data_dir: Path) -> dict[str, str]:
    """The run ids written by the first test (``_write_reports``), by their role."""
    runs = {r["run_id"]: r for r in reports.list_reports(data_dir, PIPELINE)}
    if not runs:
        return _write_reports(data_dir)
    raw = sorted(r["run_id"] for r in runs.values() if r["sink"] == "raw")
    agg = [r["run_id"] for r in runs.values() if r["sink"] == "agg"]
    return {"old-pass": raw[0], "fail": raw[1], "new-pass": raw[2], "agg-pass": agg[0]}


TRAVERSALS = [
    "%2e%2e/secret.txt",
    "%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "%2e%2e%2fsecret.txt",
    "..%2fsecret.txt",
    "%252e%252e%252fsecret.txt",
    "%25252e%25252e%25252fsecret.txt",
    "demo/raw/%2e%2e/%2e%2e/%2e%2e/secret.txt",
    "_static/%2e%2e%2f%2e%2e%2fsecret.txt",
    "%2fetc%2fpasswd",
    "%252Fetc%252Fpasswd",
    "..%5csecret.txt",
    "demo/raw/escape.json",  # a symlink inside pointing out
    "_static/.hidden.css",
    "demo/raw/nothing.json",
    "demo/raw",
]


def test_report_paths_never_leave_the_reports_folder(ui, site):
    _existing_ids(site.data_dir)
    for path in TRAVERSALS:
        r = ui.get(f"/isbflow/reports/{path}")
        assert r.status in (400, 404), (path, r.status)
        assert SECRET not in r.text and "root:" not in r.text and "hidden" != r.text, path
    assert ui.get("/isbflow/reports/%2e%2e/secret.txt").status == 400
    assert ui.get("/isbflow/reports/demo/raw/nothing.json").status == 404
    # literal dot segments, which an HTTP client would normalize away: straight to the ASGI app
    for raw in ("/isbflow/reports/../secret.txt", "/isbflow/reports/../../../../etc/passwd",
                "/isbflow/reports/demo/raw/../../../secret.txt", "/isbflow/reports//etc/passwd"):
        r = ui.get(raw, raw=True)
        assert r.status in (400, 404), (raw, r.status)
        assert SECRET not in r.text and "root:" not in r.text


def test_pages_render_with_a_message_when_nats_is_unreachable(site, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    conn = json.dumps({"conn_type": "nats", "host": "127.0.0.1", "port": port})
    child = UiChild({**site.airflow.env, "AIRFLOW_CONN_NATS_DEFAULT": conn}, tmp_path / "child.log")
    try:
        r = child.get("/isbflow/pipelines")
        assert r.status == 200
        msg = one(r.text, "id", "nats-error")[2]
        assert f"cannot reach the ISB service at nats://127.0.0.1:{port}" in msg
        sec = inner(r.text, "data-pipeline", PIPELINE)
        assert f"nats://127.0.0.1:{port}" in one(sec, "class", "msg bad nats-error")[2]
        assert {a["data-step"]: a["data-state"] for _, a, _ in find(r.text, "data-step", tag="tr")} == {
            "in": "unknown", "parse": "unknown", "raw": "unknown"}
        assert child.get("/isbflow/quality").status == 200
    finally:
        child.close()


def test_airflow_plugins_manager_loads_the_plugin(site):
    proc = subprocess.run([str(Path(sys.executable).parent / "airflow"), "plugins", "--output", "json"],
                          env=site.airflow.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plugins = json.loads(proc.stdout[proc.stdout.index("["):])
    ours = next(p for p in plugins if p["name"] == "isbflow")
    assert ours["source"] == "$PLUGINS_FOLDER/isbflow_plugin.py"
    views = {(v["name"], v["destination"]): v for v in ours["external_views"]}
    assert set(views) == {("Pipelines", "nav"), ("Quality", "nav"), ("Pipelines", "dag"), ("Quality", "dag")}
    assert views[("Pipelines", "dag")]["href"] == "/isbflow/pipelines?dag_id={DAG_ID}"
    assert views[("Quality", "nav")]["href"] == "/isbflow/quality"
    assert len({v["url_route"] for v in views.values()}) == 4
    assert [(a["url_prefix"], a["app"]) for a in ours["fastapi_apps"]] == [("/isbflow", "isbflow.airflow.ui.plugin.LazyApp")]


def test_record_rates_keeps_one_bounded_hour(site):
    async def go() -> list[dict]:
        nc = await connect(site.settings)
        try:
            s = st.StepStatus("bounded", input_rows_per_s=10.0, processed_rows_per_s=20.0)
            t0 = 1_800_000_000.0
            for i in range(70):
                s.rows_total = i  # moves every time: never idle
                await st.record_rates(nc, PIPELINE, s, now=t0 + 60 * i)
            return await st.get_rates(nc, PIPELINE, "bounded")
        finally:
            await nc.close()

    history = asyncio.run(go())
    assert len(history) == st.RATE_POINTS == 60
    assert history[0]["t"] == 1_800_000_000.0 - 1_800_000_000.0 % 60 + 60 * 10
    assert {(p["in"], p["out"], p["n"]) for p in history} == {(10.0, 20.0, 1)}


def test_runner_heartbeat_records_the_rate_history(site):
    """``PipelineRunner._heartbeat`` writes the status and folds it into ``rates.<vertex>``."""
    from types import SimpleNamespace

    from isbflow.isb.connect import SyncSession
    from isbflow.steps.runner import PipelineRunner, StepRun

    nats = SyncSession(site.settings)
    try:
        runner = SimpleNamespace(nats=nats, p=SimpleNamespace(name=PIPELINE), metrics=None,
                                 _refresh_references=lambda vertex: None,  # no reference tables here
                                 autoscaler=SimpleNamespace(look=lambda run: None))  # no scale here
        run = StepRun("beat", status=st.StepStatus("beat", state=st.Observed.RUNNING, input_rows_per_s=50.0,
                                                     processed_rows_per_s=80.0, rows_total=10))
        PipelineRunner._heartbeat(runner, run)
        run.status.rows_total = 20
        PipelineRunner._heartbeat(runner, run)
        status = nats.run(st.get_status(nats.nc, PIPELINE, "beat"))
        history = nats.run(st.get_rates(nats.nc, PIPELINE, "beat"))
    finally:
        nats.close()
    assert status is not None and status.rows_total == 20
    assert history[-1]["rows"] == 20 and history[-1]["out"] == 80.0 and sum(p["n"] for p in history) == 2


def test_real_api_server_mounts_the_plugin_behind_its_auth(site, tmp_path):
    """``airflow api-server`` on loopback: the plugin is reachable with Airflow's token only."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**site.airflow.env, **airflow_env(site.airflow.home, DAGS, api_port=port, base=site.airflow.env)}
    log = open(tmp_path / "api-server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([str(Path(sys.executable).parent / "airflow"), "api-server", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        def request(method: str, path: str, body: str | None = None, headers: dict | None = None):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request(method, path, body=body, headers=headers or {})
                resp = conn.getresponse()
                return resp.status, resp.read().decode("utf-8", "replace")
            finally:
                conn.close()

        deadline = time.monotonic() + 180
        while True:
            try:
                if request("GET", "/api/v2/monitor/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "api-server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "api-server not healthy in 180 s"
            time.sleep(1)
        password = json.loads((site.airflow.home / "simple_auth_manager_passwords.json.generated").read_text())["admin"]
        status, body = request("POST", "/auth/token", json.dumps({"username": "admin", "password": password}),
                               {"Content-Type": "application/json"})
        assert status == 201, body
        token = json.loads(body)["access_token"]
        bearer = {"Authorization": f"Bearer {token}"}

        status, body = request("GET", "/isbflow/api/pipelines")
        assert status == 401 and "parse" not in body
        status, body = request("GET", "/isbflow/pipelines", headers={"Cookie": "_token=garbage"})
        assert status == 401 and "parse" not in body
        status, body = request("GET", "/isbflow/api/pipelines", headers=bearer)
        assert status == 200 and [s["vertex"] for s in json.loads(body)["pipelines"][1]["steps"]] == [
            "in", "parse", "raw"]
        status, body = request("GET", "/isbflow/pipelines", headers={"Cookie": f"_token={token}"})
        assert status == 200 and 'data-step="parse"' in body
        for raw in ("/isbflow/reports/../secret.txt", "/isbflow/reports/../../../../../etc/passwd",
                    "/isbflow/reports/%2e%2e/secret.txt", "/isbflow/reports/%252e%252e%252fsecret.txt"):
            status, body = request("GET", raw, headers=bearer)
            assert status in (400, 404), (raw, status)
            assert SECRET not in body and "root:" not in body
        status, body = request("GET", "/api/v2/plugins", headers=bearer)
        assert status == 200
        ours = next(p for p in json.loads(body)["plugins"] if p["name"] == "isbflow")
        assert {v["url_route"] for v in ours["external_views"]} == {
            "isbflow-pipelines", "isbflow-quality", "isbflow-dag-pipelines", "isbflow-dag-quality"}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        log.close()



REDIS_SPEC = """\
apiVersion: isbflow.io/v1alpha1
kind: InterStepBufferService
metadata: {name: redis}
spec:
  redis:
    native: {persistence: true}
---
apiVersion: isbflow.io/v1alpha1
kind: Pipeline
metadata: {name: rdemo}
spec:
  interStepBufferServiceName: redis
  vertices:
    - name: in
      source:
        jetstream: {subject: rdemo.events}
        schema: "service STRING, n INT"
    - name: raw
      sink:
        delta: {path: sinks/rdemo/raw}
  edges:
    - {from: in, to: raw}
"""


def test_a_pipeline_on_redis_buffers_shows_on_the_pipelines_page(ui, site):
    """The page reads a Redis pipeline's status the same way: the service's native redis-server in
    the data dir, its steps' heartbeats and the edge's lag, from the Redis store."""
    from isbflow.isb.redis import server as redis_server
    from isbflow.ops import isb as ops_isb
    from tests.helpers.redis_server import RedisHandle

    spec = site.specs_dir / "zz-redis.yaml"
    redis_server.start_redis(site.data_dir)
    try:
        spec.write_text(REDIS_SPEC)
        admin = RedisHandle(site.data_dir, "aof").settings()
        specs = load_specs([spec])
        ops_isb.apply(admin, specs, "rdemo", data_dir=site.data_dir)
        edge = naming.EdgePartition("rdemo", "in", "raw", 0).stream

        async def heartbeats() -> None:
            store = await connect(admin)
            try:
                await st.put_status(store, "rdemo", st.StepStatus("in", state=st.Observed.RUNNING, batch_id=3))
                await st.put_status(store, "rdemo", st.StepStatus("raw", state=st.Observed.RUNNING, batch_id=2,
                                                                  lag={edge: 5}))
            finally:
                await store.close()

        asyncio.run(heartbeats())
        data = ui.get("/isbflow/api/pipelines?pipeline=rdemo").json()
        (view,) = data["pipelines"]
        assert (view["file"], view["name"], view["nats_error"]) == ("zz-redis.yaml", "rdemo", None), view
        steps = {s["vertex"]: s for s in view["steps"]}
        assert {v: (s["state"], s["stale"]) for v, s in steps.items()} == {
            "in": ("running", False), "raw": ("running", False)}
        assert steps["raw"]["lag_total"] == 5
        html = ui.get("/isbflow/pipelines?pipeline=rdemo").text
        one(html, "data-pipeline", "rdemo", tag="section")
        rows = {a["data-step"]: a["data-state"] for _, a, _ in find(html, "data-step", tag="tr")}
        assert rows == {"in": "running", "raw": "running"}

        # it reads as the store's read-only 'reader' user, not the admin: with that user off it cannot
        async def reader(state: str) -> None:
            store = await connect(admin)
            try:
                await store.client.execute_command("ACL", "SETUSER", "reader", state)
            finally:
                await store.close()

        asyncio.run(reader("off"))  # (the UI caches settings, not connections: the next read logs in again)
        assert ui.get("/isbflow/api/pipelines?pipeline=rdemo").json()["pipelines"][0]["nats_error"]
        asyncio.run(reader("on"))
        assert ui.get("/isbflow/api/pipelines?pipeline=rdemo").json()["pipelines"][0]["nats_error"] is None
    finally:
        spec.unlink(missing_ok=True)
        redis_server.stop_redis(site.data_dir)


# ------------------------------------------------------------------ the child process


def _tokens(client: Any) -> dict[str, str | None]:
    """Tokens by kind: Airflow's ``/auth/token``, one minted by its JWT generator, and bad ones."""
    import secrets as _secrets

    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from airflow.api_fastapi.auth.tokens import JWTGenerator, get_signing_args

    home = Path(os.environ["AIRFLOW_HOME"])
    password = json.loads((home / "simple_auth_manager_passwords.json.generated").read_text())["admin"]
    r = client.post("/auth/token", json={"username": "admin", "password": password})
    assert r.status_code == 201, r.text
    am = get_auth_manager()
    user = SimpleAuthManagerUser(username="admin", role="admin")
    claims = am.serialize_user(user)
    audience = am._get_jwt_audience()
    return {
        "bearer": r.json()["access_token"],
        "minted": am.generate_jwt(user),
        "expired": JWTGenerator(**get_signing_args(), valid_for=-600, audience=audience).generate(claims),
        "forged": JWTGenerator(secret_key=_secrets.token_urlsafe(32), valid_for=600,
                               audience=audience).generate(claims),
        "garbage": "not-a-jwt",
        "norole": am.generate_jwt(SimpleAuthManagerUser(username="nobody", role=None)),
    }


def _headers(tokens: dict[str, str | None], auth: str) -> dict[str, str]:
    if auth == "none":
        return {}
    if auth == "cookie":
        return {"Cookie": f"_token={tokens['bearer']}"}
    if auth == "garbage-cookie":
        return {"Cookie": "_token=not-a-jwt"}
    return {"Authorization": f"Bearer {tokens[auth]}"}


async def _asgi_get(app: Any, raw_path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], str]:
    """One GET straight into the ASGI app, the path exactly as given (no client normalizes it)."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    path, _, query = raw_path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": unquote(path), "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in {"host": "testserver", **headers}.items()],
             "client": ("127.0.0.1", 50000), "server": ("testserver", 80), "state": {}}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body.decode("utf-8", "replace")


def _dag_test(dag_id: str, conf: dict) -> dict:
    """Run a one-task stand-in DAG named ``dag_id`` once; its run lands in the metadata DB."""
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG

    with DAG(dag_id=dag_id, schedule=None, catchup=False) as dag:
        EmptyOperator(task_id="ran")
    dr = dag.test(run_conf=conf)
    return {"run_id": dr.run_id, "state": str(dr.state)}


def _child() -> None:
    from airflow.api_fastapi.app import create_app
    from fastapi.testclient import TestClient

    app = create_app("core")
    with TestClient(app) as client:
        tokens = _tokens(client)
        for line in sys.stdin:
            req = json.loads(line)
            try:
                headers = _headers(tokens, req.get("auth", "bearer"))
                if req["op"] == "dagtest":
                    out = _dag_test(req["dag_id"], req["conf"])
                elif req["op"] == "raw":
                    status, hdrs, text = asyncio.run(_asgi_get(app, req["path"], headers))
                    out = {"status": status, "headers": hdrs, "text": text}
                else:
                    r = client.get(req["path"], headers=headers, follow_redirects=False)
                    out = {"status": r.status_code, "headers": dict(r.headers), "text": r.text}
            except Exception as e:  # report to the parent instead of dying silently
                out = {"error": f"{type(e).__name__}: {e}"}
            print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    _child()
