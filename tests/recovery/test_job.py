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
