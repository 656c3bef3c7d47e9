"""Every path under the data dir, built in one place.

The data dir (``--data-dir``, ``ISBFLOW_DATA_DIR``, default ``.isbflow``)
holds all a pipeline keeps on disk besides its sinks:

    nats/                              the embedded ISB service (config, JetStream store, log)
    checkpoints/<pipeline>/<query>/    each Spark query's checkpoint (query = vertex or vertex-to-to)
    checkpoints/<pipeline>.epoch       the checkpoint epoch after a recovery
    checkpoints/<pipeline>/_recovered-<stamp>/   checkpoints a recovery moved aside
    stats/<pipeline>/<vertex>-to-<to>/ the writer's per-batch stats
    launches/                          a launched driver's record (PID, command)
    logs/                              launched drivers' logs
    airflow/                           AIRFLOW_HOME of the local platform
    quality/reports/                   quality run reports (JSON and GX data docs)

Nothing else builds these paths from strings; pipeline and vertex names are
validated by the spec (no separators), so no path leaves the data dir.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DataDir:
    """The data dir's layout (module docstring): ``DataDir(root).checkpoint("logs", "parse", "agg")``."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def nats(self) -> Path:
        return self.root / "nats"

    @property
    def launches(self) -> Path:
        return self.root.absolute() / "launches"

    @property
    def logs(self) -> Path:
        return self.root.absolute() / "logs"

    @property
    def airflow_home(self) -> Path:
        return self.root.resolve() / "airflow"

    @property
    def quality_reports(self) -> Path:
        return self.root / "quality" / "reports"

    def checkpoints(self, pipeline: str) -> Path:
        return self.root / "checkpoints" / pipeline

    def checkpoint(self, pipeline: str, vertex: str, to: str | None = None) -> Path:
        """The checkpoint of the query reading ``vertex``'s input and writing its edge to ``to``."""
        return self.checkpoints(pipeline) / query_name(vertex, to)

    def epoch_file(self, pipeline: str) -> Path:
        return self.root / "checkpoints" / f"{pipeline}.epoch"

    def stats_of(self, pipeline: str) -> Path:
        """The write stats of every query of ``pipeline``."""
        return self.root / "stats" / pipeline

    def stats(self, pipeline: str, vertex: str, to: str) -> Path:
        return self.stats_of(pipeline) / query_name(vertex, to)


def query_name(vertex: str, to: str | None) -> str:
    """A step's query: ``vertex`` (a sink) or ``vertex-to-to`` (one out edge)."""
    return vertex if to is None else f"{vertex}-to-{to}"
