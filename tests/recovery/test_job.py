"""The recovery job's helpers (isbflow.recovery.job): checkpoints moved aside, and only the newest kept."""

from __future__ import annotations

import os

from isbflow.recovery.job import RECOVERED_KEPT, aside_dir, move_aside, prune_aside


def test_moved_aside_checkpoints_keep_the_newest_recoveries(tmp_path):
    ck = tmp_path / "checkpoints" / "logs"
    for i in range(RECOVERED_KEPT + 2):
        (ck / "parse").mkdir(parents=True)
        (ck / "parse" / "offsets").write_text(str(i))
        into = aside_dir(ck, f"20261125T1000{i:02d}")
        assert move_aside([ck / "parse", ck / "missing"], into) == [str(ck / "parse")]
        os.utime(into, (1_000_000 + i, 1_000_000 + i))
    (ck / "agg").mkdir()  # a live query's checkpoint

    removed = prune_aside(ck)

    assert sorted(os.path.basename(p) for p in removed) == ["_recovered-20261125T100000",
                                                             "_recovered-20261125T100001"]
    left = sorted(p.name for p in ck.iterdir())
    assert left == ["_recovered-20261125T1000" + f"{i:02d}" for i in range(2, RECOVERED_KEPT + 2)] + ["agg"]
    assert (ck / f"_recovered-20261125T1000{RECOVERED_KEPT + 1:02d}" / "parse" / "offsets").read_text() == \
        str(RECOVERED_KEPT + 1)
    assert prune_aside(tmp_path / "none") == []


class _Held:
    def __init__(self, name: str, closed: list[str]):
        self.name, self.closed = name, closed

    def close(self) -> None:
        self.closed.append(self.name)


def _job(report, **kw):
    from isbflow.isb.connect import NatsSettings
    from isbflow.recovery.job import RecoveryJob
    from isbflow.spec.load import load_specs
    from tests.helpers.recovery import SPECS

    p = load_specs(SPECS / "fault-logs.yaml").only_pipeline()
    # never connected: publishing is skipped, so no server is needed for the lifecycle
    return RecoveryJob(NatsSettings(servers=("nats://127.0.0.1:1",)), p, report, verb="test", status_key="t", **kw)


class _Report:
    def __init__(self):
        self.pipeline, self.phases, self.seconds, self.state = "p", [], 0.0, "running"

    def to_json(self) -> dict:
        return {}


def test_a_job_fails_its_report_and_closes_what_it_owns_when_a_phase_raises():
    import pytest

    closed: list[str] = []
    report = _Report()
    with pytest.raises(ValueError, match="boom"):
        with _job(report) as job:
            job.own(_Held("first", closed))
            job.own(_Held("second", closed))
            raise ValueError("boom\nsecond line")
    assert report.state == "failed"
    assert [(ph.name, ph.state, ph.detail) for ph in report.phases] == [("error", "failed", {"error": "boom"})]
    assert closed == ["second", "first"]  # owned runs closed in reverse, before the connection


def test_an_error_whose_phase_recorded_it_adds_no_error_phase():
    import pytest

    report = _Report()
    with pytest.raises(KeyError):
        with _job(report, recorded=(KeyError,)):
            raise KeyError("already in a phase")
    assert report.state == "failed" and report.phases == []

    ok = _Report()
    with _job(ok) as job:
        job.own(_Held("x", []))
    assert ok.state == "running" and ok.phases == []
