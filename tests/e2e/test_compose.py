"""docker-compose.yml and infra/, checked for structure (no Docker engine runs here).

The same topology runs as processes on loopback in other tests (nats_cluster,
test_spark_standalone, test_airflow_postgres, test_metrics); these checks keep
the compose file honest about it: the services and their wiring, health checks,
one-shot jobs, secrets only by reference, loopback-only published ports, mounted
files that exist, and a Grafana dashboard whose queries use only metrics that
isbflow.steps.metrics exports (and every one of them).
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from isbflow.spec import load_specs
from isbflow.steps.metrics import PipelineMetrics, series_names
from tests.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD = ROOT / "infra" / "grafana" / "dashboards" / "isbflow.json"
PROMETHEUS = ROOT / "infra" / "prometheus" / "prometheus.yml"
AIRFLOW = ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
ONE_SHOT = ("airflow-init", "isb-provision")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|FERNET|TOKEN|_KEY$")


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def env(svc: dict) -> dict[str, str]:
    e = svc.get("environment") or {}
    return dict(e) if isinstance(e, dict) else dict(x.split("=", 1) for x in e)


def test_topology_has_the_services_design_names(services):
    assert {"nats-1", "nats-2", "nats-3", "spark-master", "spark-worker-1", "spark-worker-2", "postgres",
            *ONE_SHOT, *AIRFLOW, "prometheus", "grafana"} == set(services)


def test_nats_cluster_of_three_with_persistence_and_auth(services):
    conf = (ROOT / "infra" / "nats" / "cluster.conf").read_text()
    assert "store_dir: /data/jetstream" in conf and "password: $NATS_PASSWORD" in conf
    assert "authorization" in conf.split("cluster {", 1)[1], "cluster routes must be authenticated"
    for node in ("nats-1", "nats-2", "nats-3"):
        assert f"@{node}:6222" in conf
        svc = services[node]
        assert f"{node}:/data" in svc["volumes"], f"{node}: JetStream store not on a volume"
        e = env(svc)
        assert e["NATS_SERVER_NAME"] == node
        assert e["NATS_PASSWORD"].startswith("${NATS_PASSWORD") and e["NATS_ROUTE_PASSWORD"].startswith("${")


def test_spark_master_and_two_workers(services):
    master = services["spark-master"]["command"]
    assert master[:2] == ["spark-class", "org.apache.spark.deploy.master.Master"]
    for w in ("spark-worker-1", "spark-worker-2"):
        cmd = services[w]["command"]
        assert cmd[:3] == ["spark-class", "org.apache.spark.deploy.worker.Worker", "spark://spark-master:7077"]
        assert services[w]["depends_on"] == {"spark-master": {"condition": "service_healthy"}}
        assert "isbflow-data:/isbflow" in services[w]["volumes"], "executors write sink files to the shared volume"
    conf = (ROOT / "infra" / "spark" / "spark-defaults.conf").read_text()
    for line in ("spark.authenticate                  true", "spark.network.crypto.enabled        true",
                 "spark.master.rest.enabled           false"):
        assert line in conf
    assert env(services["spark-master"])["_SPARK_AUTH_SECRET"].startswith("${SPARK_AUTH_SECRET")


def test_airflow_on_postgres_with_one_executor_and_shared_secrets(services):
    envs = [env(services[name]) for name in AIRFLOW]
    for name, e in zip(AIRFLOW, envs, strict=True):
        assert e["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://airflow:${POSTGRES_PASSWORD")
        assert e["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith("@postgres:5432/airflow")
        assert e["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"  # justified in the file's header
        assert services[name]["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                                "airflow-init": {"condition": "service_completed_successfully"}}
    for key in ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API__SECRET_KEY",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL"):
        assert len({e[key] for e in envs}) == 1, f"{key} must be the same in every Airflow component"
    assert services["airflow-api-server"]["command"][:2] == ["airflow", "api-server"]
    assert services["airflow-scheduler"]["command"] == ["airflow", "scheduler"]
    assert services["airflow-dag-processor"]["command"] == ["airflow", "dag-processor"]
    assert services["airflow-triggerer"]["command"] == ["airflow", "triggerer"]
    assert "LocalExecutor" in COMPOSE.read_text().split("services:")[0]  # the choice is explained


def test_health_checks_and_one_shot_jobs(services):
    for name, svc in services.items():
        if name in ONE_SHOT:
            assert svc["restart"] == "no" and "healthcheck" not in svc, name
        else:
            assert svc.get("healthcheck", {}).get("test"), f"{name} has no health check"
    assert services["airflow-init"]["command"] == ["airflow", "db", "migrate"]
    assert services["isb-provision"]["command"][:3] == ["isbflow", "isb", "apply"]
    assert set(services["isb-provision"]["depends_on"]) == {"nats-1", "nats-2", "nats-3"}


def test_no_secret_inline_and_published_ports_on_loopback(services):
    text = COMPOSE.read_text()
    for m in re.finditer(r"(\w*PASSWORD\w*|password)\s*:\s+(\S+)", text):  # YAML keys, not ${X:?..}
        assert m.group(2).strip("\"'").startswith("${"), f"inline secret: {m.group(0)}"
    for name, svc in services.items():
        for key, value in env(svc).items():
            if SECRET_NAME.search(key):
                assert str(value).startswith("${"), f"{name}: {key} is set inline"
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    referenced = set(re.findall(r"\$\{([A-Z_]+)", text))
    example = {ln.split("=", 1)[0] for ln in (ROOT / "infra" / "env.example").read_text().splitlines()
               if "=" in ln and not ln.startswith("#")}
    assert referenced <= example, f"not in infra/env.example: {referenced - example}"
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_mounted_files_volumes_and_build_exist(services):
    declared = set(yaml.safe_load(COMPOSE.read_text())["volumes"])
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in declared, f"{name} uses undeclared volume {src}"
        build = svc.get("build")
        if build:
            assert (ROOT / build["context"] / build["dockerfile"]).is_file()


def test_prometheus_discovers_the_step_processes(services):
    conf = yaml.safe_load(PROMETHEUS.read_text())
    job = next(j for j in conf["scrape_configs"] if j["job_name"] == "isbflow")
    (files,) = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    # the records isbflow.steps.metrics.serve writes under <data dir>/metrics/, on the shared volume
    assert files == "/isbflow/metrics/*.json"
    assert "isbflow-data:/isbflow:ro" in services["prometheus"]["volumes"]
    sched = env(services["airflow-scheduler"])
    assert sched["ISBFLOW_HOME"] == "/isbflow" and sched["ISBFLOW_METRICS_PORT"] == "-1"
    assert sched["ISBFLOW_METRICS_HOST"] == "0.0.0.0"


def _dashboard_queries() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in d["panels"] for t in p["targets"]]
    for var in d["templating"]["list"]:
        q = var.get("query")
        queries.append(q["query"] if isinstance(q, dict) else q)
    return queries


def test_dashboard_queries_use_exported_metrics_and_cover_them_all():
    pipeline = load_specs([ROOT / "tests" / "specs" / "standalone-logs.yaml"]).only_pipeline()
    registry = PipelineMetrics(pipeline).registry
    exported = series_names(registry)
    used = {m for q in _dashboard_queries() for m in re.findall(r"\bisbflow_[a-z_]+", q)}
    assert used and used <= exported, f"dashboard queries unknown series: {sorted(used - exported)}"
    families = {f.name for f in registry.collect()}
    covered = {f for f in families if any(u == f or u.startswith(f + "_") for u in used)}
    assert covered == families, f"metrics without a panel: {sorted(families - covered)}"


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus(services):
    prov = ROOT / "infra" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    dash = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    assert uids == {ds["uid"]}
    provider = yaml.safe_load((prov / "dashboards" / "isbflow.yaml").read_text())["providers"][0]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./infra/grafana/dashboards"] == provider["options"]["path"]
    assert env(services["grafana"])["GF_SECURITY_ADMIN_PASSWORD"].startswith("${")
