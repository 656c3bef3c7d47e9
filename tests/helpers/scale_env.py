"""The demo pipeline run as a user runs it: ``isbflow pipeline run`` in a subprocess.

:class:`DemoRun` provisions ``tests/specs/standalone-logs.yaml`` (the demo's
vertices and transforms, small buffers and batches) on a test's nats-server,
loads the ``services`` reference table, produces deterministic events, and runs
the real command with the environment :func:`isbflow.steps.driver.driver_env`
gives a launched driver (credentials in ``NATS_*`` variables, never on the
command line). The subprocess has its own Spark driver (the test session's
SparkSession is not involved).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from deltalake import DeltaTable

from isbflow.isb import provision, reference
from isbflow.isb.connect import NatsSettings
from isbflow.isb.dlq import read_dead_letters
from isbflow.ops.produce import is_malformed, produce
from isbflow.spec import load_specs
from isbflow.steps.driver import driver_env
from tests.conftest import ROOT

SPEC = ROOT / "tests" / "specs" / "standalone-logs.yaml"
ISBFLOW = str(Path(sys.executable).parent / "isbflow")
SEED = 7


class DemoRun:
    """The small demo spec on one nats-server, with its own isbflow data dir."""

    def __init__(self, settings: NatsSettings, data_dir: Path, spec: Path = SPEC):
        self.settings = settings
        self.data_dir = Path(data_dir)
        self.spec = spec
        self.specs = load_specs([spec])
        self.p = self.specs.only_pipeline()
        asyncio.run(provision.apply(settings, self.specs))
        rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
        asyncio.run(reference.put(settings, self.p.name, "services", rows))

    def produce(self, count: int, malformed_every: int | None = 500, start: int = 0) -> None:
        report = asyncio.run(produce(self.settings, self.p, count=count, seed=SEED, start=start,
                                     malformed_every=malformed_every))
        assert report.published == count, report

    @staticmethod
    def good_ids(count: int, malformed_every: int | None = 500, start: int = 0) -> set[str]:
        """``_isb_id`` of the well-formed events ``start..start+count`` (event i sits at sequence i + 1)."""
        return {f"in/0/{i + 1}" for i in range(start, start + count) if not is_malformed(i, malformed_every)}

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**driver_env(self.settings, self.data_dir, workdir=ROOT), **(extra or {})}

    def command(self, *args: str, trigger: str = "available-now", master: str = "local[2]") -> list[str]:
        return [ISBFLOW, "pipeline", "run", "-f", str(self.spec), "--trigger", trigger, "--master", master,
                "--data-dir", str(self.data_dir), *args]

    def run(self, *args: str, master: str = "local[2]", extra_env: dict[str, str] | None = None,
            timeout: float = 600) -> tuple[dict, subprocess.CompletedProcess]:
        """``pipeline run --trigger available-now --json``; returns its JSON result and the process."""
        proc = subprocess.run(self.command("--json", *args, master=master), env=self.env(extra_env), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        return json.loads(proc.stdout), proc

    def raw_ids(self) -> list[str]:
        table = DeltaTable(str(self.data_dir / "sinks" / "logs" / "raw")).to_pyarrow_table(columns=["_isb_id"])
        return table.column("_isb_id").to_pylist()

    def dead_letters(self) -> list[dict]:
        return asyncio.run(read_dead_letters(self.settings, self.p.name, "in"))
