"""``isbflow sink maintain`` run as a user would: the installed console script, in a subprocess."""

from __future__ import annotations

import json
import subprocess

import pyarrow as pa
from deltalake import DeltaTable

from isbflow.cli.sink import RETENTION_DEFAULT_TEXT
from isbflow.sinks.delta import DeltaSinkOptions, commit_batch, sink_app_id, write_batch_files
from isbflow.sinks.maintain import DEFAULT_RETENTION_HOURS
from isbflow.sinks.tables import sink_table_path
from isbflow.spec import load_specs
from tests.conftest import ROOT
from tests.helpers.provision import write_spec

ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")


def sink(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ISBFLOW, "sink", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, cwd=ROOT)


def test_maintain_refuses_a_short_retention_dry_runs_then_compacts(tmp_path):
    f = write_spec(tmp_path)
    p = load_specs([f]).only_pipeline()
    data = tmp_path / "data"
    name = next(v.name for v in p.spec.vertices if v.sink is not None)
    path = sink_table_path(p, name, data)
    opts = DeltaSinkOptions.from_options({"path": path, "appId": sink_app_id(p.name, "x", name)})
    for b in range(4):
        rows = pa.table({"_isb_id": [f"in/0/{b * 10 + i}" for i in range(1, 11)]})
        commit_batch(opts, [write_batch_files(opts, rows.to_batches(), b, 0)], b)
    common = ["-f", str(f), "--data-dir", str(data), "--sink", name]

    refused = sink("maintain", *common, "--retention-hours", "1")
    assert refused.returncode == 2 and "below the floor" in refused.stderr
    dry = sink("maintain", *common, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)[name]
    assert (report["version_before"], report["version_after"], report["files_before"]) == (3, 3, 4)
    assert DeltaTable(path).version() == 3
    done = sink("maintain", *common)
    assert done.returncode == 0, done.stderr
    assert "files 4 -> 1" in done.stdout
    assert len(DeltaTable(path).file_uris()) == 1
    unknown = sink("maintain", "-f", str(f), "--data-dir", str(data), "--sink", "nope")
    assert unknown.returncode == 2 and "has no sink nope" in unknown.stderr


def test_the_help_states_the_retention_default():
    assert RETENTION_DEFAULT_TEXT.startswith(f"{DEFAULT_RETENTION_HOURS} ")
