"""Every path under the data dir, built in one place.

The data dir (``--data-dir``, ``ISBFLOW_HOME``, default ``.isbflow``)
holds all a pipeline keeps on disk besides its sinks:

    nats/                              the embedded ISB service (config, JetStream store, log)
    checkpoints/<pipeline>/<query>/    each Spark query's checkpoint (query = vertex, or vertex-to-to
                                       for a vertex with one out edge)
    checkpoints/<pipeline>/_per-edge-<stamp>/   per-edge checkpoints carried over to one query per vertex
    checkpoints/<pipeline>.epoch       the checkpoint epoch after a recovery
    checkpoints/<pipeline>/_recovered-<stamp>/   checkpoints a recovery moved aside
    stats/<pipeline>/<vertex>-to-<to>/ the writer's per-batch stats
    run/<pipeline>/<vertex>.nowait     while present, the step's reader does not wait for new data
    launches/                          a launched driver's record (PID, command)
    logs/                              launched drivers' logs
    airflow/                           AIRFLOW_HOME of the local platform
    quality/reports/                   quality run reports (JSON and GX data docs)
    shadow/<pipeline>/<run>/           a shadow reprocess: run.json (its record) and a shadow table per raw sink

Nothing else builds these paths from strings; pipeline and vertex names are
validated by the spec (no separators), so no path leaves the data dir.

The data dir is private to its user: :meth:`DataDir.ensure` creates it with
mode 0700 (and takes group and other access away from an existing one), and
folders isbflow creates inside it are made 0700 by :func:`private_dir` (Spark
writes checkpoints with the umask ``077``: see ``steps.runner.spark_session``).
Sinks, checkpoints, quality reports and logs are then unreadable by other
local users.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: the mode of the data dir and of every folder isbflow creates in it
PRIVATE_DIR_MODE = 0o700


def write_private(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (mode 0600 whatever the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def private_secret(path: str | os.PathLike, make: Callable[[], str] = lambda: secrets.token_urlsafe(24)) -> str:
    """The secret kept in ``path`` (owner-only), made with ``make`` on first use and kept across restarts."""
    path = Path(path)
    if path.exists():
        return path.read_text().strip()
    value = make()
    write_private(path, value)
    return value


def private_dir(path: str | os.PathLike) -> Path:
    """``mkdir -p`` where every folder created gets mode 0700 (whatever the umask); existing
    folders are left as they are. Returns the path."""
    path = Path(path)
    missing = []
    for p in (path, *path.parents):
        if p.is_dir():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            p.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            if not p.is_dir():
                raise
            continue
        os.chmod(p, PRIVATE_DIR_MODE)  # mkdir's mode is masked by the umask; only ever narrower
    return path


@dataclass(frozen=True)
class DataDir:
    """The data dir's layout (module docstring): ``DataDir(root).checkpoint("logs", "parse", "agg")``."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    def ensure(self) -> Path:
        """Create the data dir with mode 0700, or take group and other access away from an
        existing one (its owner's bits stay). Returns the root."""
        private_dir(self.root)
        mode = stat.S_IMODE(self.root.stat().st_mode)
        if mode & 0o077:
            try:
                os.chmod(self.root, mode & ~0o077)
            except PermissionError:  # not its owner: nothing isbflow may change
                pass
        return self.root

    def make(self, path: str | os.PathLike) -> Path:
        """A folder under the data dir, created private (the data dir too): ``dd.make(dd.logs)``."""
        self.ensure()
        return private_dir(path)

    @property
    def nats(self) -> Path:
        return self.root / "nats"

    @property
    def redis(self) -> Path:
        """The embedded redis-server's folder (its config, passwords, append-only files)."""
        return self.root / "redis"

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

    def shadows(self, pipeline: str) -> Path:
        """Every shadow reprocess run of ``pipeline``."""
        return self.root.absolute() / "shadow" / pipeline

    def shadow(self, pipeline: str, run: str) -> Path:
        """One shadow reprocess run: its record ``run.json`` and a folder per shadow table."""
        return self.shadows(pipeline) / run

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

    def no_wait(self, pipeline: str, vertex: str) -> Path:
        """While this file exists, step ``vertex``'s reader does not wait for new data (the runner
        creates it before draining or stopping the step; ``isbflow.isb.wait``)."""
        return self.root.absolute() / "run" / pipeline / f"{vertex}.nowait"


def query_name(vertex: str, to: str | None) -> str:
    """A step's query: ``vertex`` (a sink, or a vertex with several out edges) or ``vertex-to-to``
    (one out edge)."""
    return vertex if to is None else f"{vertex}-to-{to}"


#: the environment variable naming the folder a spec's secret files must be in (:func:`secrets_dir`)
SECRETS_ENV = "ISBFLOW_SECRETS_DIR"


class SecretFileError(ValueError):
    """A spec names a secret file outside the secrets folder; the message names the field and the folder."""


def secrets_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The only folder a spec's secret files (a postgres sink's ``passwordFile``, the ISB service's
    ``auth.userPasswordFile``, ``auth.tokenFile`` and ``auth.credsFile``) are read from:
    ``ISBFLOW_SECRETS_DIR``, default ``<data dir>/secrets`` (the data dir: ``data_dir``, else
    ``ISBFLOW_HOME``, else ``.isbflow``). A spec then cannot send any file its user may read (an
    owner-only key, the ISB admin's password) to a host the spec names."""
    configured = os.environ.get(SECRETS_ENV)
    if configured:
        return Path(configured)
    return Path(data_dir if data_dir is not None else os.environ.get("ISBFLOW_HOME", ".isbflow")) / "secrets"


def secret_file(path: str, field: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The real path of the secret file ``path`` names for spec field ``field`` (a relative path is
    relative to the data dir, as :func:`secrets_dir` finds it): it must lie inside :func:`secrets_dir`
    once symlinks are resolved, else :class:`SecretFileError` naming the field and the folder.
    Whether the file exists is the reader's to say."""
    base = Path(data_dir if data_dir is not None else os.environ.get("ISBFLOW_HOME", ".isbflow"))
    named = Path(path).expanduser()
    real = Path(os.path.realpath(named if named.is_absolute() else base / named))
    folder = secrets_dir(data_dir)
    top = Path(os.path.realpath(folder))
    if real == top or top not in real.parents:
        raise SecretFileError(
            f"{field} {path!r} is outside the secrets folder {folder}: secret files a spec names are read "
            f"only from there (set {SECRETS_ENV} to choose it); move the file into it")
    return real
