"""Fixtures shared by the suite: real nats-server processes, cleaned up by PID.

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

# Spark's Python workers must run the venv's python (NOTES.md), on loopback.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


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
def nats_server(tmp_path_factory):
    """A fresh single-node nats-server with JetStream and auth, for one test."""
    yield from _start(tmp_path_factory, 1)


@pytest.fixture
def nats_cluster(tmp_path_factory):
    """A fresh 3-node JetStream cluster (R3 capable) on loopback, for one test."""
    yield from _start(tmp_path_factory, 3)
