"""Fixtures shared by the suite: real nats-server processes, cleaned up by PID.

The suite mirrors the package: ``tests/<package>/test_<module>.py`` for ``isbflow/<package>/``
(spec, isb, connector, sinks, steps, recovery, quality, ops, cli, airflow, platform);
``tests/e2e/`` runs the whole platform (one ``isbflow platform up`` shared by the browser and
lifecycle tests), the benchmarks' ``--quick`` runs and the security checks;
``tests/helpers/`` holds what several folders share (Airflow homes, the live platform,
recovery runs, provisioning, test sources and transforms); ``tests/test_layout.py`` checks the
package's shape (no private name across modules, modules that fit in a head).

Each fixture starts its servers under its own temporary data dir with the same
code ``isbflow nats up`` uses, and stops them by PID at teardown.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from isbflow.isb.connect import NatsSettings, resolve_settings
from isbflow.isb.server import ServerState, start_embedded, stop_embedded

ROOT = Path(__file__).resolve().parent.parent

# A pytest-xdist worker's __main__ has neither a __spec__ nor a __file__, which PySpark's
# pyspark.sql.connect (imported by Great Expectations) takes for a doctest run: it then calls
# sys.exit(0) when an optional Spark Connect dependency is missing (pyspark/sql/connect/utils.py).
_main = sys.modules["__main__"]
if getattr(_main, "__spec__", None) is None and not hasattr(_main, "__file__"):
    _main.__file__ = "<pytest-xdist worker>"

# Spark's Python workers must run the venv's python, on loopback.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# The suite is CPU-bound on 2 cores (4,918 CPU-seconds of 2,579 s wall in one measured run): most
# JVMs it starts (the in-process session, every Airflow task's and detached driver's) live for
# seconds, where the C2 compiler costs more than it returns. C1 only and the serial collector cut
# a short Spark job from 21.5-24.3 to 14.5-15.1 CPU-seconds (/tmp probe: session, an aggregation,
# a Python UDF). Tests only: `make run` and the benchmarks keep the JVM's defaults.
# Each of those JVMs also maps Spark's classes from one class-data-sharing archive written once by a
# warm-up JVM (tests/helpers/jvm_cds.py: a short Spark job's JVM 9.3-9.5 -> 5.0-5.4 CPU-seconds).
if "SPARK_SUBMIT_OPTS" not in os.environ:
    from tests.helpers.jvm_cds import with_archive

    # C1 alone reserves only 48 MB of code cache (tiered: 240 MB): the live platform's driver, a JVM
    # that runs seven queries for many minutes, filled it ("CodeCache is full. Compiler has been
    # disabled.", then interpreted code so slow that the platform's drain took over 600 s)
    os.environ["SPARK_SUBMIT_OPTS"] = (with_archive("-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
                                       + " -XX:ReservedCodeCacheSize=240m")


class NatsFixture:
    def __init__(self, data_dir: Path, state: ServerState):
        self.data_dir = data_dir
        self.state = state

    @property
    def url(self) -> str:
        return self.state.url

    @property
    def settings(self) -> NatsSettings:
        return resolve_settings(data_dir=self.data_dir)


def _start(tmp_path_factory: pytest.TempPathFactory, cluster: int):
    data_dir = tmp_path_factory.mktemp("isbflow")
    state = start_embedded(data_dir, cluster=cluster)
    try:
        yield NatsFixture(data_dir, state)
    finally:
        stop_embedded(data_dir)


@pytest.fixture
def redis_server():
    """A throwaway redis-server (tests.helpers.redis_server): 127.0.0.1, a password, stopped by PID;
    a machine without redis-server fails the test, never skips it."""
    # lazy: only the Redis tests import redis-py
    from tests.helpers.redis_server import running_redis

    with running_redis() as r:
        yield r


@pytest.fixture
def nats_server(tmp_path_factory):
    """A fresh single-node nats-server with JetStream and auth, for one test."""
    yield from _start(tmp_path_factory, 1)


@pytest.fixture
def nats_cluster(tmp_path_factory):
    """A fresh 3-node JetStream cluster (R3 capable) on loopback, for one test."""
    yield from _start(tmp_path_factory, 3)


@pytest.fixture(scope="session")
def spark():
    """One SparkSession (local[2], loopback, UTC) for the whole suite, with every
    isbflow data source registered plus the in-memory test source ``isb-memory``."""
    from pyspark import SparkContext

    from isbflow.steps.runner import spark_session
    from tests.helpers.memory_source import MemoryDataSource

    session = spark_session("local[2]", app_name="isbflow-tests", conf={"spark.ui.enabled": "false"})
    session.dataSource.register(MemoryDataSource)
    session.sparkContext.setLogLevel("ERROR")
    gateway = SparkContext._gateway
    try:
        yield session
    finally:
        session.stop()
        proc = gateway.proc
        gateway.shutdown()
        proc.terminate()
        proc.wait(timeout=60)
        SparkContext._gateway = None
        SparkContext._jvm = None


# The session's one migrated Airflow DB and the AIRFLOW_HOME built from it, for every folder.
from tests.helpers.airflow_env import airflow_home, migrated_airflow_db  # noqa: E402, F401


def pytest_configure(config):
    # opt-in: ISBFLOW_TEST_CPU=<file.tsv> records each test's wall, CPU and process starts
    from tests.helpers.cpu_recorder import register

    register(config)


#: the e2e files that share one live platform (tests/e2e/conftest.py): one worker runs them in order
_PLATFORM_FILES = ("tests/e2e/test_browser.py", "tests/e2e/test_platform.py")
#: Airflow files of long DAG runs (their tests wait more than they compute: 1,480 s wall for 586 CPU-s
#: as one unit in a measured run), each its own unit so both workers can wait on them; a worker that
#: runs any Airflow unit migrates its own Airflow DB once (session fixtures are per worker)
_AIRFLOW_RUNS = ("tests/airflow/test_dags.py", "tests/airflow/test_pipeline_operators.py",
                 "tests/airflow/test_postgres.py", "tests/e2e/test_security.py")
#: the longest units, longest first (wall seconds of a quiet serial run, 2026-11-24/25)
_LONG = ("live-platform", "tests/recovery/test_faults.py", "tests/airflow/test_dags.py",
         "tests/airflow/test_pipeline_operators.py", "tests/e2e/test_security.py", "tests/airflow/test_postgres.py", "tests/e2e/test_bench_soak.py",
         "tests/recovery/test_recover.py", "tests/e2e/test_bench_quick.py", "tests/e2e/test_bench_cost.py",
         "tests/recovery/test_reprocess.py", "tests/recovery/test_shadow.py", "tests/steps/test_runner.py",
         "tests/steps/test_postgres_pipeline.py", "tests/test_tutorial.py", "tests/recovery/test_faults_redis.py",
         "tests/recovery/test_recover_redis.py", "tests/recovery/test_recover_redis_flush.py",
         "tests/ops/test_zero_redis.py")


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to under ``make test``'s two pytest-xdist workers.

    A file is one unit (its module fixtures, a PostgreSQL server or a Spark pipeline, start once);
    the short Airflow files are one (with the worker's migrated Airflow DB and DAG-runner process);
    the two files of the shared live platform are one, run in order.
    """
    path = nodeid.split("::", 1)[0]
    if path in _PLATFORM_FILES:
        return "live-platform"
    if path in _AIRFLOW_RUNS:
        return path  # a long file of DAG runs, mostly waiting on its DAG's tasks: its own unit
    if path.startswith("tests/airflow/"):
        return "airflow"
    return path


@pytest.hookimpl(optionalhook=True)  # pytest -p no:xdist runs without it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` hands out :func:`unit_of`'s units (xdist's own grouping marks do not
    reach its scheduler under pytest 9.2, whose node ids it can no longer rewrite)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # lazy: only the xdist controller needs it

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The longest units first: xdist hands out units in the order they first appear, so neither
    worker is left with a long unit at the end (stable: each unit keeps its tests' order)."""
    units = [unit_of(item.nodeid) for item in items]
    first = {u: i for i, u in reversed(list(enumerate(units)))}
    rank = {id(item): (_LONG.index(u) if u in _LONG else len(_LONG), first[u]) for item, u in zip(items, units, strict=True)}
    items.sort(key=lambda it: rank[id(it)])
