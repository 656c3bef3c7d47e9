"""``isbflow quality verify``: the offline proof from a Delta table's commits and data alone.

Tables are written here with deltalake the way the sink commits them (each
commit's ``isb.offsets`` naming its rows' source offsets), then edited outside
isbflow; no NATS, no Spark. The exit code of the command is tested in a child
process (deltalake can abort at interpreter exit).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake

from isbflow.isb import ledger
from isbflow.quality.verify import verify_table
from tests.conftest import ROOT


def _rows(seqs, part: str = "in/0") -> pa.Table:
    seqs = list(seqs)
    return pa.table({"_isb_id": [f"{part}/{s}" for s in seqs], "v": [float(s) for s in seqs]})


def _commit(path: Path, rows: pa.Table, **extra) -> None:
    offsets = ledger.id_ranges(rows.column("_isb_id"))
    meta = {ledger.OFFSETS_KEY: ledger.to_metadata(offsets), **extra}
    write_deltalake(str(path), rows, mode="append", commit_properties=CommitProperties(custom_metadata=meta))


def _sink(tmp_path: Path) -> Path:
    """A clean sink: three batches, a hole at 11..12 (dead letters, say), two source partitions."""
    path = tmp_path / "sinks" / "logs" / "raw"
    _commit(path, _rows(range(1, 11)))
    _commit(path, _rows(range(13, 31)))
    _commit(path, _rows(range(1, 6), "in/1"))
    return path


def test_a_clean_table_is_proven_and_an_edited_one_fails_naming_the_ranges(tmp_path):
    path = _sink(tmp_path)
    DeltaTable(str(path)).optimize.compact()  # maintenance changes no data
    clean = verify_table(path)
    assert clean.ok and clean.problems() == []
    assert clean.proven == clean.claimed == {"in/0": [[1, 10], [13, 30]], "in/1": [[1, 5]]}

    # outside isbflow: 3 rows appended twice, one deleted, one updated
    write_deltalake(str(path), _rows([20, 21, 22]), mode="append")
    DeltaTable(str(path)).delete("_isb_id = 'in/0/7'")
    DeltaTable(str(path)).update(updates={"v": "-1.0"}, predicate="_isb_id = 'in/1/2'")
    bad = verify_table(path)
    assert not bad.ok
    assert bad.missing == {"in/0": [[7, 7]]}
    assert bad.duplicated == {"in/0": [[20, 22]]} and bad.surplus_rows == 3
    assert bad.unrecorded == {}
    assert [(c.operation, c.added, c.removed) for c in bad.foreign] == [
        ("WRITE", {"in/0": [[20, 22]]}, {}), ("DELETE", {}, {"in/0": [[7, 7]]}), ("UPDATE", {}, {})]
    assert bad.foreign[2].rewritten["in/1"] == [[1, 5]]  # the rewritten file's rows: possibly changed
    assert bad.proven == {"in/0": [[1, 6], [8, 10], [13, 19], [23, 30]], "in/1": [[1, 5]]}
    problems = bad.problems()
    assert any("version 4 (WRITE) was committed outside isbflow" in p and "added in/0 20..22" in p
               for p in problems), problems
    assert any("(rows deleted): in/0 7" in p for p in problems), problems
    assert any("3 id(s) held more than once (3 surplus row(s)): in/0 20..22" in p for p in problems), problems


def test_a_reprocessed_range_holds_what_the_new_code_wrote(tmp_path):
    path = _sink(tmp_path)
    # reprocess of in/0 13..30: the new code drops 15 (replace_keys: one merge commit, range in isb.offsets)
    new = _rows([s for s in range(13, 31) if s != 15])
    meta = {ledger.OFFSETS_KEY: ledger.to_metadata({"in/0": [[13, 30]]}), "isb.operation": "replace_keys",
            "isb.key": "_isb_id"}
    (DeltaTable(str(path)).merge(new, predicate="t._isb_id = s._isb_id", source_alias="s", target_alias="t",
                                 commit_properties=CommitProperties(custom_metadata=meta))
     .when_matched_update_all().when_not_matched_insert_all()
     .when_not_matched_by_source_delete(predicate="t._isb_id = 'in/0/15'").execute())
    r = verify_table(path)
    assert r.ok, r.problems()
    assert r.claimed == {"in/0": [[1, 10], [13, 14], [16, 30]], "in/1": [[1, 5]]}


def _spec(tmp_path: Path) -> Path:
    text = (ROOT / "pipelines" / "logs.yaml").read_text()
    spec = tmp_path / "logs.yaml"
    spec.write_text(text)
    return spec


def _verify_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "isbflow"
    return subprocess.run([str(exe), "quality", "verify", "-f", str(_spec(tmp_path)), "--data-dir", str(tmp_path),
                           *args], capture_output=True, text=True, timeout=120)


def test_quality_verify_exits_0_on_a_clean_sink_and_1_on_an_edited_one(tmp_path):
    path = _sink(tmp_path)
    ok = _verify_cli(tmp_path, "--sink", "raw", "--json")
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert [(r["sink"], r["ok"]) for r in out] == [("raw", True)]
    assert out[0]["proven"] == {"in/0": [[1, 10], [13, 30]], "in/1": [[1, 5]]}
    DeltaTable(str(path)).delete("_isb_id = 'in/0/3'")
    bad = _verify_cli(tmp_path)  # every sink: agg has no table here
    assert bad.returncode == 1, (bad.stdout, bad.stderr)
    assert "raw: FAILED" in bad.stdout and "(rows deleted): in/0 3" in bad.stdout
    assert "version 3 (DELETE) was committed outside isbflow" in bad.stdout
    assert "agg: not verified (no Delta table at" in bad.stdout
