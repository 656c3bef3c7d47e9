"""The platform through a real browser: Debian's Chromium driven by Playwright.

The session's platform (tests/e2e/conftest.py: ``isbflow platform up`` on free loopback
ports and a temporary data dir: NATS, Airflow, the demo pipeline running with a producer),
shared with the lifecycle tests of test_platform.py, which stop it. Then, as a user would:

1. log in through Airflow's login form;
2. open the isbflow Pipelines page and see every demo step ``running`` with non-zero rates;
3. trigger ``pipeline_replay`` through its trigger form (mode recover, dry run, a run id
   typed in the advanced options) and see the run succeed;
4. run ``pipeline_quality`` (REST API), open the Quality page, find the newest report of
   the raw sink (the run id the task's XCom names) and open its full report;
5. open a shadow reprocess's diff on the Quality page.

Screenshots of each step go to ``tests/artifacts/browser/`` (git-ignored). The browser is
``/usr/bin/chromium`` (``apt-get install chromium``; ``.ci/run`` installs it), never a
browser Playwright downloads.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from isbflow import platform
from tests.helpers.live_platform import ROOT, Api, steps_running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "tests" / "artifacts" / "browser"
SPEC = ROOT / "pipelines" / "logs.yaml"
PIPELINE = "logs"
STEPS = ["in", "parse", "enrich", "minutely", "raw", "agg", "errors"]
UI_TIMEOUT_MS = 60_000


@dataclass
class Live:
    state: platform.PlatformState
    password: str
    api: Api

    @property
    def url(self) -> str:
        return self.state.url


@pytest.fixture(scope="module")
def live(demo_platform):
    """The session's platform (tests/e2e/conftest.py: ``isbflow platform up`` as ``make run`` runs it,
    shared with the lifecycle tests, which stop it last) once every demo step runs."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    demo_platform.first()
    wait_for(lambda: steps_running(demo_platform.data_dir), 300, "every step of the demo to run")
    state = platform.read_state(demo_platform.data_dir)
    password = platform.admin_password(Path(state.airflow_home))
    assert password, "Airflow wrote no admin password"
    return Live(state, password, Api(state.url, password))


@pytest.fixture(scope="module")
def page(live, tmp_path_factory):
    """One Chromium page (fresh profile) for the module's tests, in order."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, args=CHROMIUM_ARGS,
            headless=True, viewport={"width": 1400, "height": 1000})
        ctx.set_default_timeout(UI_TIMEOUT_MS)
        try:
            yield ctx.new_page()
        finally:
            ctx.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_login_through_the_form(live, page):
    page.goto(live.url + "/")
    page.wait_for_url("**/auth/login**")
    page.fill("input[name=username]", platform.ADMIN)
    page.fill("input[name=password]", live.password)
    shot(page, "01-login-form")
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda u: "/auth/login" not in u)
    page.get_by_role("button", name="Browse").wait_for()
    shot(page, "02-home")
    assert any(c["name"] == "_token" for c in page.context.cookies())


def _step_rows(page) -> dict[str, dict]:
    """Each demo step's row on the Pipelines page: state and rates as the page shows them now."""
    return page.evaluate("""(pipeline) => {
      const out = {};
      document.querySelectorAll(`section.pipeline[data-pipeline="${pipeline}"] tr[data-step]`).forEach(tr => {
        const rate = (k) => parseFloat(tr.querySelector(`[data-rate="${k}"]`).textContent.replace(/,/g, "")) || 0;
        const badge = tr.querySelector('[data-field="stale"]');
        out[tr.dataset.step] = {state: tr.dataset.state, input: rate("input"), processed: rate("processed"),
                                stale: tr.dataset.stale, staleShown: badge.offsetParent !== null};
      });
      return out;
    }""", PIPELINE)


def test_pipelines_page_shows_the_demo_running(live, page):
    page.goto(live.url + "/isbflow/pipelines")
    page.locator("#pipelines").wait_for()
    assert sorted(_step_rows(page)) == sorted(STEPS)
    moved: set[str] = set()  # steps seen with a non-zero rate (the page refreshes itself)

    def all_running_and_moved() -> dict | None:
        rows = _step_rows(page)
        moved.update(v for v, r in rows.items() if r["state"] == "running" and (r["input"] > 0 or r["processed"] > 0))
        ok = len(rows) == len(STEPS) and all(r["state"] == "running" for r in rows.values()) and moved >= set(STEPS)
        return rows if ok else None

    try:
        rows = wait_for(all_running_and_moved, 240, "every demo step running with a non-zero rate", every=3.0)
    finally:
        shot(page, "03-pipelines")
    assert all(rows[v]["state"] == "running" for v in STEPS), rows
    assert not [v for v in STEPS if rows[v]["stale"] == "true" or rows[v]["staleShown"]], f"steps shown stale: {rows}"


def test_replay_through_the_trigger_form(live, page):
    run_id = f"browser-replay-{uuid.uuid4().hex[:8]}"
    page.goto(live.url + "/dags/pipeline_replay")
    page.get_by_test_id("trigger-dag-button").click()
    form = page.get_by_role("dialog")
    form.locator("input[name=element_mode]").wait_for(state="attached")
    assert form.locator("input[name=element_pipeline]").input_value() == "logs.yaml"
    assert form.locator("input[name=element_mode]").input_value() == "recover"
    dry_run = form.locator("input[name=element_dry_run]")
    if not dry_run.is_checked():
        form.locator("label:has(input[name=element_dry_run])").click()  # the switch wraps a hidden input
    assert dry_run.is_checked()
    form.get_by_role("button", name="Advanced Options").click()
    form.locator("input[name=dagRunId]").fill(run_id)
    shot(page, "04-replay-form")
    form.get_by_test_id("trigger-dag-submit").click()

    run = wait_for(lambda: _run_or_none(live.api, "pipeline_replay", run_id), 60, f"DAG run {run_id} to exist")
    assert run["conf"]["mode"] == "recover" and run["conf"]["dry_run"] is True, run["conf"]
    state = live.api.wait_run("pipeline_replay", run_id, 600)
    page.goto(f"{live.url}/dags/pipeline_replay/runs/{run_id}")
    page.get_by_text(run_id).first.wait_for()
    shot(page, "05-replay-run")
    assert state == "success", live.api.task_log("pipeline_replay", run_id, "replay")
    plan = live.api.xcom("pipeline_replay", run_id, "replay")
    assert plan, "the replay task pushed no report"


def _run_or_none(api: Api, dag_id: str, run_id: str) -> dict | None:
    try:
        return api("GET", f"dags/{dag_id}/dagRuns/{run_id}")
    except Exception:  # noqa: BLE001 - 404 until the form's request is through
        return None


def test_quality_page_shows_the_newest_report(live, page):
    run_id = f"browser-quality-{uuid.uuid4().hex[:8]}"
    live.api.trigger("pipeline_quality", run_id, {"pipeline": "logs.yaml"})
    state = live.api.wait_run("pipeline_quality", run_id, 600)
    out = live.api.xcom("pipeline_quality", run_id, "quality")
    assert out and out.get("sinks"), f"run {state}, XCom {out!r}:\n" + \
        live.api.task_log("pipeline_quality", run_id, "quality")
    raw = next(s for s in out["sinks"] if s["sink"] == "raw")
    assert state == ("success" if out["ok"] else "failed"), (state, out)

    page.goto(live.url + "/isbflow/quality")
    page.locator("#quality").wait_for()
    newest = page.locator(f'section.sink[data-pipeline="{PIPELINE}"][data-sink="raw"] tr[data-run]').first
    shot(page, "06-quality")
    assert newest.get_attribute("data-run") == raw["run_id"]
    assert newest.get_attribute("data-result") == ("pass" if raw["success"] else "fail")

    with page.expect_response(lambda r: "/isbflow/reports/" in r.url) as report:
        newest.locator("a.report").click()
    assert report.value.status == 200, report.value.url
    page.wait_for_load_state()
    time.sleep(1.0)  # let the report's own styles settle before the screenshot
    shot(page, "07-quality-report")


def test_quality_page_opens_a_shadow_diff(live, page):
    """A shadow run's report beside the live sink's (written as ``isbflow replay --shadow`` writes it: a
    quality report tagged with the run and a diff computed by ``diff_rows`` from the live raw sink's
    rows and the same rows with ``team`` changed); the Quality page shows its badge, and its foldout
    opens on the changed column and the sample values."""
    from deltalake import DeltaTable

    from isbflow.quality import reports
    from isbflow.quality.checks import CheckResult
    from isbflow.quality.run import QualityReport
    from isbflow.recovery.shadow_diff import diff_rows

    data_dir = Path(live.state.data_dir)
    raw_path = str(data_dir / "sinks" / "logs" / "raw")
    live_rows = DeltaTable(raw_path).to_pyarrow_table().slice(0, 20)
    new = live_rows.set_column(live_rows.schema.get_field_index("team"), "team",
                               pa.array(["reviewed-team"] * live_rows.num_rows))
    diff = diff_rows(live_rows, new, ["_isb_id"])
    seqs = [int(i.rsplit("/", 1)[1]) for i in live_rows.column("_isb_id").to_pylist()]
    run, now = "reprocess-20991231T000000Z", datetime.now(UTC)
    run_id = reports.new_run_id(now)
    report = QualityReport(run_id=run_id, pipeline=PIPELINE, sink="raw", kind="raw",
                           table_path=str(data_dir / "shadow" / PIPELINE / run / "raw"), table_version=0,
                           rows=new.num_rows, time=now.isoformat(), gate="fail", success=True,
                           checks=[CheckResult("schema", True)],
                           shadow={"run": run, "live_path": raw_path, "live_version": DeltaTable(raw_path).version(),
                                   "range": {"in/0": [[min(seqs), max(seqs)]]}, "diff": diff})
    reports.save_report(data_dir, report.to_dict(), None)

    page.goto(live.url + "/isbflow/quality")
    page.locator("#quality").wait_for()
    row = page.locator(f'tr[data-run="{run_id}"]')
    assert row.locator(f'[data-shadow="{run}"]').inner_text() == f"shadow {run}"
    assert row.locator(".diff-counts").get_attribute("data-changed") == str(diff["changed"]) != "0"
    foldout = page.locator(f'details[data-shadow-run="{run}"]')
    changed_team = foldout.locator('table.diff-columns tr[data-column="team"]')
    assert not changed_team.is_visible()
    foldout.locator("summary").click()
    changed_team.wait_for(state="visible")
    assert changed_team.get_attribute("data-changed") == str(diff["changed"])
    sample = foldout.locator('table.diff-samples tr[data-column="team"]').first
    assert "reviewed-team" in sample.inner_text()
    shot(page, "08-quality-shadow-diff")
