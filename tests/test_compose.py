"""docker-compose.yml, checked for structure (no Docker engine runs here)."""

from __future__ import annotations

import re

import yaml

from tests.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"


def load():
    return yaml.safe_load(COMPOSE.read_text())


def test_topology_has_the_services_design_names():
    services = set(load()["services"])
    assert {"nats-1", "nats-2", "nats-3", "spark-master", "spark-worker", "postgres", "isb-provision",
            "airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"} <= services


def test_no_secret_inline_and_published_ports_on_loopback():
    text = COMPOSE.read_text()
    for m in re.finditer(r"(PASSWORD|password)\s*:\s*(\S+)", text):
        assert m.group(2).strip("\"'").startswith("${"), f"inline secret: {m.group(0)}"
    for name, svc in load()["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_mounted_infra_files_exist_and_routes_name_every_node():
    for svc in load()["services"].values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), src
    conf = (ROOT / "infra" / "nats" / "cluster.conf").read_text()
    for node in ("nats-1", "nats-2", "nats-3"):
        assert f"@{node}:6222" in conf
    assert "authorization" in conf.split("cluster {", 1)[1], "cluster routes must be authenticated"
