"""``isbflow.ops.zero_policy``: which pipelines may scale to zero, and when one is idle.

Fast unit tests (no server, no Spark): a vertex that does not allow zero keeps the pipeline
awake whatever it measures; the idle clock starts again on anything pending, any step not
running, any batch run. The watcher itself runs against a real nats-server and a real driver in
tests/ops/test_zero.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from isbflow.cli import app
from isbflow.ops import zero
from isbflow.ops.zero_policy import IdleClock, Look, policy, refusal
from isbflow.spec import load_specs

SPEC = Path(__file__).resolve().parent.parent / "specs" / "zero-mini.yaml"


def pipeline(tmp_path: Path, old: str = "", new: str = ""):
    text = SPEC.read_text()
    assert old in text
    path = tmp_path / "p.yaml"
    path.write_text(text.replace(old, new, 1))
    return path, load_specs([path]).only_pipeline()


def test_a_pipeline_whose_vertices_all_allow_zero_gets_numaflows_numbers(tmp_path):
    _, p = pipeline(tmp_path)
    assert refusal(p) is None
    rule = policy(p)
    assert rule.idle_seconds == 2  # the largest scaleDownCooldownSeconds
    assert rule.peek_seconds == 5  # the source vertex's zeroReplicaSleepSeconds
    assert 1 <= rule.look_seconds <= rule.idle_seconds


@pytest.mark.parametrize(("old", "new", "why"), [
    ("scale: {min: 0, scaleDownCooldownSeconds: 2}", "scale: {min: 1, scaleDownCooldownSeconds: 2}",
     "vertex 'raw' has scale.min: 1: it keeps at least one replica"),
    ("scale: {min: 0, scaleDownCooldownSeconds: 2}", "scale: {min: 0, disabled: true}",
     "vertex 'raw' has scale.disabled: true"),
    ("      scale: {min: 0, scaleDownCooldownSeconds: 2}\n", "", "vertex 'raw' has no scale"),
])
def test_a_vertex_that_does_not_allow_zero_keeps_the_pipeline_awake(tmp_path, old, new, why):
    path, p = pipeline(tmp_path, old, new)
    assert why in (refusal(p) or "")
    with pytest.raises(ValueError, match=why):
        policy(p)
    # the watcher refuses before it connects, locks or starts anything (no server runs here)
    with pytest.raises(zero.ZeroError, match=why):
        zero.watch(path, load_specs([path]), p, None, tmp_path / "data", stop=threading.Event())
    assert not (tmp_path / "data").exists()
    # the command says so in one line, exit 2
    result = CliRunner().invoke(app, ["pipeline", "scale-to-zero", "-f", str(path), "--data-dir",
                                      str(tmp_path / "data")])
    assert result.exit_code == 2, result.output
    assert why in result.output and "Traceback" not in result.output


def test_a_files_source_cannot_wake_a_sleeping_pipeline(tmp_path):
    _, p = pipeline(tmp_path, "jetstream:\n          subject: zero.events", "files:\n          path: landing")
    assert "vertex 'in' is a files source" in (refusal(p) or "")


def look(at: float, pending: int = 0, state: str = "running", batch: int = 3) -> Look:
    return Look(at, {"src-zero-in": pending, "isb-zero-in-raw-0": 0}, {"in": state, "raw": "running"},
                {"in": batch, "raw": 7})


def test_the_idle_clock_runs_only_while_nothing_is_pending_and_nothing_runs():
    clock = IdleClock()
    assert clock.feed(look(0.0)) == 0.0 and clock.why == []
    assert clock.feed(look(1.5)) == 1.5
    assert clock.feed(look(2.0, pending=4)) == 0.0
    assert clock.why == ["src-zero-in has 4 pending"]
    assert clock.feed(look(3.0)) == 0.0  # idle again from here
    assert clock.feed(look(4.0, batch=4)) == 0.0  # the source step ran a batch since the last look
    assert clock.why == ["step in finished batch 4"]
    assert clock.feed(look(5.0, batch=4)) == 0.0
    assert clock.feed(look(6.0, batch=4, state="starting")) == 0.0
    assert clock.why == ["step in is starting"]
    assert clock.feed(look(7.0, batch=4)) == 0.0
    assert clock.feed(look(9.5, batch=4)) == 2.5


def test_a_sleeping_or_unknown_step_is_not_idle_while_awake():
    """Right after a wake the steps still read sleeping (or have no heartbeat): the new driver
    must run a while before it can be drained away again."""
    assert look(0.0, state="sleeping").busy() == ["step in is sleeping"]
    assert look(0.0, state="unknown").busy() == ["step in is unknown"]
