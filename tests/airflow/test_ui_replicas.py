"""A step's autoscaler on the Pipelines page and in ``isbflow pipeline status``: the heartbeat's
``replicas`` (the last decision) shows as replicas / desired with the decision in words
(isbflow.airflow.ui.collect, pipelines.html, isbflow.ops.status.replicas_line). No NATS: the view
from a heartbeat as the runner writes it."""

from __future__ import annotations

import time

from isbflow.airflow.ui import render as render_mod
from isbflow.airflow.ui.collect import static_view, step_view
from isbflow.airflow.ui.models import PipelinesResponse
from isbflow.airflow.ui.render import render
from isbflow.isb.state import StepStatus
from isbflow.ops.status import replicas_line
from isbflow.spec import load_specs
from tests.conftest import ROOT

P = load_specs([ROOT / "tests" / "specs" / "autoscale.yaml"]).only_pipeline()
DECISION = {"vertex": "in", "pending": [96_000], "rate": 41_000.0, "current": 1, "desired": 2, "target": 2, "min": 1,
            "max": 2, "direction": "up", "why": "backlog", "cooldown_left_s": 0.0, "at": 0.0, "ups": 1, "downs": 0,
            "looks": 3, "executors": {"target": 2, "live": 1}}


def test_the_status_line_says_replicas_desired_why_and_executors():
    line = replicas_line("in", StepStatus("in", replicas=DECISION))
    assert line == "in: replicas 2, desired 2 (1..2; backlog: pending [96000], 41,000.0 rows/s); executors 1 of 2"
    held = {**DECISION, "target": 1, "why": "scale-up cooldown", "cooldown_left_s": 3.4, "executors": None}
    assert replicas_line("in", StepStatus("in", replicas=held)).endswith("41,000.0 rows/s, 3s of cooldown left)")
    assert replicas_line("raw", StepStatus("raw")) is None and replicas_line("raw", None) is None


def test_the_pipelines_page_shows_replicas_and_desired_of_a_scaled_step():
    now = time.time()
    view = static_view("autoscale.yaml", P)
    view.steps = [step_view(P, "in", StepStatus("in", state="running", replicas=DECISION, updated_at=now), "running",
                            [], now, 30.0),
                  step_view(P, "raw", StepStatus("raw", state="running", updated_at=now), "running", [], now, 30.0)]
    assert [(s.vertex, s.current_replicas, s.desired_replicas) for s in view.steps] == [("in", 2, 2), ("raw", None, None)]
    data = PipelinesResponse(pipelines_dir="x", generated_at=now, stale_after_s=30.0, pipelines=[view])
    html = render("pipelines.html", base="/isbflow", nonce="n", page="pipelines", data=data, chart_w=render_mod.CHART_W,
                  chart_h=render_mod.CHART_H, chart_pad=render_mod.CHART_PAD, window_s=render_mod.WINDOW_S, refresh_ms=5000)
    row = html.split('<tr data-step="in"')[1].split("</tr>")[0]
    assert 'data-replicas="2" data-desired-replicas="2"' in row and ">2 / 2</td>" in row
    assert 'title="in: replicas 2, desired 2 (1..2; backlog' in row
    raw = html.split('<tr data-step="raw"')[1].split("</tr>")[0]
    assert 'data-replicas="" data-desired-replicas=""' in raw
    assert "replicas / desired" in html and "s.current_replicas" in html  # the header, and the refresh's script
