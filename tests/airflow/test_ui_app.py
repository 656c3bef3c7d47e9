"""The UI app's Quality page rendering a shadow reprocess's diff (isbflow.airflow.ui.app), fast.

The app is the plugin's own (``create_app``), served by starlette's TestClient in
this process with the auth dependency replaced (the auth itself is tested
against Airflow in test_ui_plugin.py; this process never imports Airflow).
Reports are written as a quality run writes them: a :class:`QualityReport` of
the live sink and one of a shadow table tagged with its run and a diff that
:func:`isbflow.recovery.shadow_diff.diff_rows` computed.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient

from isbflow.airflow.ui.app import create_app
from isbflow.airflow.ui.auth import require_user
from isbflow.quality import reports
from isbflow.quality.checks import CheckResult
from isbflow.quality.run import QualityReport
from isbflow.recovery.shadow_diff import diff_rows
from tests.airflow.test_ui_plugin import find, inner, one

RUN = "reprocess-20260501T121500Z"


def _report(run_id: str, when: datetime, *, shadow: dict | None = None, failures=()) -> dict:
    checks = [CheckResult("schema", True), *failures]
    return QualityReport(run_id=run_id, pipeline="rp", sink="raw", kind="raw",
                         table_path=f"/data/shadow/rp/{RUN}/raw" if shadow else "/data/sinks/rp/raw",
                         table_version=0 if shadow else 7, rows=6, time=when.isoformat(), gate="fail",
                         success=not failures, checks=checks, shadow=shadow).to_dict()


@pytest.fixture
def client(tmp_path, monkeypatch):
    data_dir, specs = tmp_path / "data", tmp_path / "pipelines"
    specs.mkdir()
    monkeypatch.setenv("ISBFLOW_HOME", str(data_dir))
    monkeypatch.setenv("ISBFLOW_PIPELINES_DIR", str(specs))
    app = create_app(url_prefix="")
    app.dependency_overrides[require_user] = lambda: "reviewer"
    with TestClient(app) as c:
        yield c, data_dir


def test_quality_page_shows_a_shadow_diff_beside_its_suite(client):
    c, data_dir = client
    old = pa.table({"_isb_id": ["in/0/1", "in/0/2", "in/0/3"], "version": [1, 1, 1], "msg": ["a", "b", "<b>x</b>"]})
    new = pa.table({"_isb_id": ["in/0/2", "in/0/3", "in/0/4"], "version": [2, 1, 2], "msg": ["b", "<b>y</b>", "d"]})
    diff = diff_rows(old, new, ["_isb_id"])
    t0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    live_id = reports.new_run_id(t0)
    shadow_id = reports.new_run_id(t0 + timedelta(minutes=15))
    reports.save_report(data_dir, _report(live_id, t0), None)
    tag = {"run": RUN, "live_path": "/data/sinks/rp/raw", "live_version": 7, "range": {"in/0": [[1, 4]]},
           "diff": diff}
    reports.save_report(data_dir, _report(shadow_id, t0 + timedelta(minutes=15), shadow=tag,
                                          failures=[CheckResult("expect_column_values_to_be_between", False,
                                                                unexpected_count=2, origin="spec")]), None)

    data = c.get("/api/quality").json()
    runs = data["sinks"][0]["runs"]
    assert [r["run_id"] for r in runs] == [shadow_id, live_id]
    assert runs[1]["shadow"] is None
    s = runs[0]["shadow"]
    assert (s["run"], s["live_version"], s["added"], s["removed"], s["changed"], s["unchanged"]) == (RUN, 7, 1, 1, 2, 0)
    assert s["columns"] == {"version": 1, "msg": 1}

    r = c.get("/quality")
    assert r.status_code == 200
    html = r.text
    # the sink's "latest" badge is the live sink's newest run, not the shadow's
    assert one(html, "data-latest")[1]["data-latest"] == "pass"
    row = inner(html, "data-run", shadow_id)
    assert one(row, "data-shadow")[1]["data-shadow"] == RUN
    assert [a["data-check"] for _, a, _ in find(row, "data-check")] == ["expect_column_values_to_be_between"]
    counts = one(row, "class", "diff-counts")[1]
    assert (counts["data-added"], counts["data-removed"], counts["data-changed"]) == ("1", "1", "2")
    assert not find(inner(html, "data-run", live_id), "data-shadow")
    assert one(html, "data-diff", shadow_id, tag="tr")
    summary = one(html, "data-shadow-run", RUN, tag="details")[2]
    details = inner(html, "data-shadow-run", RUN)  # the foldout's content
    assert "against /data/sinks/rp/raw (version 7)" in summary and "~2 changed" in summary
    assert "range: in/0 1..4" in details
    assert {a["data-column"]: a["data-changed"] for t, a, _ in find(details, "data-changed", tag="tr")} == \
        {"version": "1", "msg": "1"}
    changed = [(a["data-key"], a["data-column"], txt) for _, a, txt in find(details, "data-key", tag="tr")]
    assert [(k, col) for k, col, _ in changed] == [("in/0/2", "version"), ("in/0/3", "msg")]
    assert changed[0][2] == '{"_isb_id": "in/0/2"}version12'
    assert changed[1][2] == '{"_isb_id": "in/0/3"}msg"<b>x</b>""<b>y</b>"'  # the values as text...
    added = one(details, "data-kind", "added", tag="ul")
    assert "in/0/4" in added[2]
    assert "in/0/1" in one(details, "data-kind", "removed", tag="ul")[2]
    # sample values are data: escaped, never markup
    assert "<b>x</b>" not in html and "<b>y</b>" not in html
    assert f"--promote {RUN}" in details
