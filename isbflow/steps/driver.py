"""A detached driver's command line and environment: what ``isbflow pipeline run`` gets when a
launch (:mod:`isbflow.steps.launch`) or a batch run starts it.

:func:`driver_command` is the argument list (no shell; a master URL or a trigger interval that
could be read as another argument is refused); :func:`driver_env` is the environment: no
Airflow or NATS variable of the caller's passes, except the ``AIRFLOW_CONN_<ID>`` a pipeline's
PostgreSQL sinks name; the ISB settings go in ``NATS_*`` variables (credentials never on the
command line).

**The driver's log.** A launch writes the driver's stdout and stderr to one file, whose path
it passes in ``ISBFLOW_DRIVER_LOG``; the driver runs :func:`cap_own_log`, a thread that rotates
that file past :data:`isbflow.local.files.LOG_MAX_BYTES` (16 MiB) every few seconds, keeping one
older part (``<log>.1``): a driver's log is at most ~32 MiB however long it runs.

**What user code can reach.** A driver runs its pipeline's transforms, in its own Python and in
the Python workers its JVM starts. Before it starts them, :func:`confine` takes the ISB secrets
out of its environment (its connections carry them in memory) and hides the embedded ISB
service's folder ``<data dir>/nats/`` (the admin's and every role's password, the users block, the
JetStream store) from the driver and everything it starts (:func:`isbflow.local.sandbox.hide`,
Landlock; ``ISBFLOW_SANDBOX=off`` turns it off): a transform holds only its own pipeline's
credentials, and cannot read or change the others'.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from isbflow.isb.connect import IsbSettings, RedisSettings
from isbflow.isb.roles import pipeline_user
from isbflow.isb.server import role_password_file
from isbflow.local.files import LOG_MAX_BYTES, rotate_log
from isbflow.local.sandbox import Hidden, forget_env, hide
from isbflow.sinks.postgres import PostgresSinkError, check_connection_type, connection_env
from isbflow.spec.models import Pipeline
from isbflow.spec.paths import DataDir

#: the environment variable naming a launched driver's own log file (module docstring)
LOG_ENV = "ISBFLOW_DRIVER_LOG"
#: seconds between two size checks of a driver's log
LOG_CHECK_S = 5.0
PROCESSING_TIME = re.compile(r"\d+(\.\d+)? ?(milliseconds?|ms|seconds?|s|minutes?)")  # a trigger interval


def check_processing_time(value: str) -> str:
    """``value`` when it is a trigger interval Spark takes (``'200 milliseconds'``, ``'5 seconds'``,
    ``'5s'``), else :class:`LaunchError` naming it."""
    if not PROCESSING_TIME.fullmatch(value):
        raise LaunchError(f"processing time {value!r} is not an interval such as '200 milliseconds' or '5 seconds'")
    return value


_UNIT_S = {"ms": 0.001, "millisecond": 0.001, "milliseconds": 0.001, "s": 1.0, "second": 1.0, "seconds": 1.0,
           "minute": 60.0, "minutes": 60.0}


def interval_s(value: str) -> float:
    """Seconds of a trigger interval :func:`check_processing_time` takes (``'200 milliseconds'``: 0.2)."""
    m = PROCESSING_TIME.fullmatch(check_processing_time(value.strip()))
    return float(m.string[:m.start(2)]) * _UNIT_S[m.group(2)]


class LaunchError(Exception):
    """A pipeline could not be launched or run; the message says what, where and what to do."""


def settings_env(settings: IsbSettings) -> dict[str, str]:
    """Environment variables that make :func:`isbflow.isb.connect.resolve_settings` find ``settings``.

    Credentials go in their own variables; the URLs carry none.
    """
    if isinstance(settings, RedisSettings):
        return {k: v for k, v in (("REDIS_URL", settings.url), ("REDIS_USER", settings.user),
                                  ("REDIS_PASSWORD", settings.password)) if v}
    s = settings.with_auth_from_urls()
    env = {"NATS_URL": ",".join(s.servers)}
    for name, value in (("NATS_USER", s.user), ("NATS_PASSWORD", s.password), ("NATS_TOKEN", s.token),
                        ("NATS_CREDS", s.creds_file), ("NATS_TLS_CA", s.tls_ca),
                        ("NATS_TLS_CERT", s.tls_cert), ("NATS_TLS_KEY", s.tls_key)):
        if value:
            env[name] = value
    if s.tls_insecure:
        env["NATS_TLS_INSECURE"] = "true"
    return env


def sink_connections(p, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``AIRFLOW_CONN_<ID>`` variables (from ``base``, default ``os.environ``) of the Airflow
    connections pipeline ``p``'s PostgreSQL sinks name, and only those: a launched driver's
    environment (:func:`driver_env`) has no other Airflow variable. :class:`LaunchError` when a sink
    names a connection that is not of type postgres (the ISB's ``nats_default``, say): it is never
    passed on."""
    src = os.environ if base is None else base
    out: dict[str, str] = {}
    for v in p.spec.vertices:
        if v.sink is None or v.sink.postgres is None or not v.sink.postgres.connection:
            continue
        conn_id = v.sink.postgres.connection
        name = connection_env(conn_id)
        if name not in src:
            continue  # not defined: the sink's own error names the variable
        try:
            check_connection_type(conn_id, src[name], f"pipeline {p.name!r}, postgres sink {v.name!r}")
        except PostgresSinkError as e:
            raise LaunchError(str(e)) from None
        out[name] = src[name]
    return out


#: glibc's malloc arenas for a driver's processes (``MALLOC_ARENA_MAX``; a user's value is kept). glibc
#: gives each thread that contends for malloc an arena of its own, up to 8 per core, and each keeps
#: its freed memory: the driver JVM runs ~420 threads (Spark's block-manager pools alone hold 200)
#: and held 83 MiB in 16 arenas on the demo; with 2, 61 MiB in 2, and the driver tree's PSS mean
#: fell 1,256 -> 1,237 MiB at the same CPU (bench/cost.py, 100 events/s, one run each).
MALLOC_ARENAS = "2"


def driver_env(settings: IsbSettings, data_dir: str | Path, workdir: str | Path | None = None,
               base: dict[str, str] | None = None, pipeline: Pipeline | None = None) -> dict[str, str]:
    """The driver's environment: ``base`` (default ``os.environ``) without Airflow's, NATS's and Redis's
    variables, plus the ISB settings, the data dir, Spark's Python and loopback binding, and for
    ``pipeline`` the ``AIRFLOW_CONN_<ID>`` its PostgreSQL sinks name (no other Airflow variable)."""
    src = os.environ if base is None else base
    env = {k: v for k, v in src.items() if not k.startswith(("AIRFLOW", "NATS_", "REDIS_"))}
    env.update(settings_env(settings))
    env.update({
        "ISBFLOW_HOME": str(Path(data_dir).absolute()),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": env.get("SPARK_LOCAL_IP") or "127.0.0.1",
        "PATH": str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)
    if workdir is not None:  # user transforms (spark_apps/) import from there
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(workdir).absolute()),
                                                        env.get("PYTHONPATH")) if p)
    if pipeline is not None:
        env.update(sink_connections(pipeline, src))
    return env


def driver_command(spec_file: str | Path, *, data_dir: str | Path, trigger: str = "continuous",
                   master: str = "local[2]", pipeline: str | None = None,
                   steps: Sequence[str] | None = None, json_out: bool = False,
                   processing_time: str | None = None) -> list[str]:
    """``isbflow pipeline run`` (or ``step run`` for one step) as a client-mode driver on this host.

    A list of arguments, run without a shell; ``master`` (a DAG parameter) must not look like
    an option or hold whitespace, so it cannot be taken for another argument. ``processing_time``:
    the trigger interval, ``--processing-time`` (e.g. ``"200 milliseconds"``; default the spec's readTimeout)."""
    isbflow = Path(sys.executable).parent / "isbflow"
    if not master or master.startswith("-") or any(c.isspace() or not c.isprintable() for c in master):
        raise LaunchError(f"Spark master {master!r} is not a master URL (e.g. local[2], spark://host:7077)")
    if processing_time is not None:
        check_processing_time(processing_time)
    if steps and len(steps) > 1:
        raise LaunchError(f"cannot launch steps {', '.join(steps)} together: launch the whole pipeline "
                          "(steps=None) or one step at a time")
    cmd = [str(isbflow) if isbflow.exists() else sys.executable]
    if not isbflow.exists():
        cmd += ["-c", "import sys; from isbflow.cli import main; sys.argv[0] = 'isbflow'; main()"]
    cmd += (["step", "run", "--step", steps[0]] if steps else ["pipeline", "run"])
    cmd += ["-f", str(Path(spec_file).absolute()), "--trigger", trigger, "--master", master,
            "--data-dir", str(Path(data_dir).absolute())]
    if pipeline:
        cmd += ["--pipeline", pipeline]
    cmd += ["--processing-time", processing_time] if processing_time is not None else []
    if json_out:
        cmd.append("--json")
    return cmd


def cap_own_log(max_bytes: int = LOG_MAX_BYTES, interval: float = LOG_CHECK_S) -> threading.Thread | None:
    """In a launched driver: a daemon thread rotating the log named by ``ISBFLOW_DRIVER_LOG`` past
    ``max_bytes`` (:func:`isbflow.local.files.rotate_log`) every ``interval`` seconds; None when the
    variable is unset (a driver run by hand writes where its caller says)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return None

    def run() -> None:
        while True:
            rotate_log(path, max_bytes)
            time.sleep(interval)

    t = threading.Thread(target=run, name="isbflow-log-cap", daemon=True)
    t.start()
    return t


#: the environment variables holding ISB secrets, which :func:`confine` takes out of a driver's environment
SECRET_ENV = ("NATS_PASSWORD", "NATS_TOKEN", "REDIS_PASSWORD")


def driver_folders(p: Pipeline, data_dir: str | Path) -> list[Path]:
    """The folders pipeline ``p``'s driver writes under (made, where needed, before :func:`confine`):
    its checkpoints, stats, run flags, metrics records and logs, and its Delta sinks and fallbacks
    (relative paths live under the data dir)."""
    # lazy: steps.metrics loads prometheus_client, which only a driver needs
    from isbflow.steps.metrics import record_path

    dd = DataDir(Path(data_dir).absolute())
    out = [dd.checkpoints(p.name), dd.stats_of(p.name), dd.no_wait(p.name, "_").parent,
           record_path(dd.root, "_").parent, dd.logs]
    for v in p.spec.vertices:
        for delta in (v.sink.delta, v.sink.fallback.delta if v.sink.fallback else None) if v.sink else ():
            if delta is not None:
                out.append(Path(delta.path) if Path(delta.path).is_absolute() else dd.root / delta.path)
    return out


def confine(p: Pipeline, data_dir: str | Path, settings: IsbSettings) -> Hidden | None:
    """In pipeline ``p``'s driver, before it starts Spark (module docstring): the ISB secrets out of
    its environment (:data:`SECRET_ENV`), and the store's folder (``<data dir>/nats/``, or
    ``<data dir>/redis/`` for a Redis store) hidden from it and from every
    process it starts, but for the files its own ``settings`` name there (a TLS CA, say) and its own
    user's password file. Returns what :func:`isbflow.local.sandbox.hide` did (None: nothing hidden:
    no embedded server under ``data_dir``, ``ISBFLOW_SANDBOX=off``, or a kernel without Landlock).
    Irreversible: for a driver process of its own (``isbflow pipeline run``)."""
    forget_env(SECRET_ENV)
    dd = DataDir(Path(data_dir).absolute())
    if isinstance(settings, RedisSettings):
        own = [f for f in (settings.tls_ca,) if f] + [dd.redis / f"{pipeline_user(p.name)}.password"]
        return hide(dd.redis, keep=driver_folders(p, data_dir), readable=own)
    s = settings.with_auth_from_urls()
    own = [f for f in (s.tls_ca, s.tls_cert, s.tls_key, s.creds_file) if f]
    own.append(role_password_file(data_dir, pipeline_user(p.name)))
    return hide(dd.nats, keep=driver_folders(p, data_dir), readable=own)
