"""Security: secrets stay owner-only and out of every log; spec values cannot inject arguments.

Extends tests/isb/test_server.py (single node: password, conf and state file
0600, anonymous refused) and tests/isb/test_connect.py (wrong password, masking):

- on a 3-node cluster, *every* file under the data dir that holds the client
  or route password is owner-only in an owner-only folder, and no other file
  (state, ports, logs) holds one; every node refuses anonymous clients, a wrong
  password and the route credentials used as a client;
- a pipeline run (``isbflow pipeline run`` subprocess, NATS auth on, Spark
  event logging on) and an Airflow DAG run (``pipeline_batch`` via
  ``dag.test()``) leave the NATS password nowhere: not in their stdout/stderr,
  Spark's event logs (Spark properties, SQL plans with the data sources'
  options), the data dir (driver logs, checkpoints, stats, Delta logs) or
  Airflow's task logs under ``AIRFLOW_HOME/logs``;
- names, URLs and paths from a spec that reach command lines and folders are
  rejected by validation with file and field (``--master=x``, ``a;rm -rf``,
  ``../x``), and the launcher runs a list of arguments, never a shell.
"""

from __future__ import annotations

import ast
import asyncio
import shutil
import stat
import sys
from pathlib import Path

import pytest
import yaml

from isbflow.isb.connect import IsbUnreachable, connect, resolve_settings, settings_from_url
from isbflow.isb.roles import pipeline_grants, pipeline_user
from isbflow.isb.server import HOST, grant_pipelines
from isbflow.platform import nats_connection_json
from isbflow.spec import SpecError, load_specs
from isbflow.steps.launch import LaunchError, driver_command, launch
from tests.conftest import ROOT
from tests.helpers.scale_env import SPEC, DemoRun
from tests.test_layout import parse

COUNT = 1500


# ---------------------------------------------------------------------------------- secrets at rest

def test_only_owner_only_files_hold_cluster_secrets(nats_cluster):
    nats_dir = nats_cluster.data_dir / "nats"
    secrets = {(nats_dir / f).read_text().strip()
               for f in ("password", "route-password", "reader.password", "producer.password")}
    assert len(secrets) == 4 and all(len(s) >= 24 for s in secrets)
    holders = set()
    for f in nats_cluster.data_dir.rglob("*"):
        if not f.is_file():
            continue
        text = f.read_bytes().decode(errors="replace")
        if any(s in text for s in secrets):
            holders.add(f.relative_to(nats_dir).as_posix())
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, (f, oct(f.stat().st_mode))
    # the users' passwords in their files and the included users block; the route's in the node confs
    assert holders == {"password", "route-password", "reader.password", "producer.password", "auth.conf",
                       "n1.conf", "n2.conf", "n3.conf"}
    assert stat.S_IMODE(nats_dir.stat().st_mode) == 0o700
    for f in [f for f in nats_dir.iterdir() if f.is_file()]:  # confs, state, ports, logs: owner-only too
        assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0, (f, oct(f.stat().st_mode))


def test_every_cluster_node_refuses_anonymous_wrong_and_route_credentials(nats_cluster):
    nats_dir = nats_cluster.data_dir / "nats"
    route_pw = (nats_dir / "route-password").read_text().strip()
    ports = [n.client_port for n in nats_cluster.state.nodes]
    assert len(ports) == 3
    urls = [url for port in ports for url in (f"nats://{HOST}:{port}", f"nats://isbflow:wrong-password@{HOST}:{port}",
                                              f"nats://route:{route_pw}@{HOST}:{port}")]

    async def refusal(url: str) -> str | None:
        try:
            nc = await connect(settings_from_url(url), timeout=2)
        except IsbUnreachable as e:
            return str(e)
        await nc.close()
        return None

    async def all_at_once() -> list[str | None]:  # each refusal takes seconds: side by side, not in turn
        return list(await asyncio.gather(*(refusal(u) for u in urls)))

    for url, error in zip(urls, asyncio.run(all_at_once()), strict=True):
        assert error is not None and "authorization violation" in error, (url, error)
        assert route_pw not in error and "wrong-password" not in error
    # ... while the client credentials work on every node
    async def works(url: str) -> bool:
        nc = await connect(settings_from_url(url))
        try:
            return nc.is_connected
        finally:
            await nc.close()

    assert [asyncio.run(works(u)) for u in nats_cluster.state.urls] == [True, True, True]


# ---------------------------------------------------------------------------------- secrets in logs

def _event_log_conf(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """SPARK_CONF_DIR with event logging on (uncompressed), so the test can read what Spark records."""
    conf, events = tmp_path / "spark-conf", tmp_path / "spark-events"
    conf.mkdir()
    events.mkdir()
    (conf / "spark-defaults.conf").write_text(
        f"spark.eventLog.enabled true\nspark.eventLog.dir file://{events}\nspark.eventLog.compress false\n")
    return {"SPARK_CONF_DIR": str(conf)}, events


def _files_holding(secret: str, *roots: Path) -> list[str]:
    found = []
    for root in roots:
        for f in [root] if root.is_file() else root.rglob("*"):
            if f.is_file() and secret.encode() in f.read_bytes():
                found.append(str(f))
    return found


def _check_event_log(events: Path) -> str:
    """The event log text (checked to hold what a leak would be in: properties and SQL plans)."""
    text = "".join(f.read_text(errors="replace") for f in events.rglob("*") if f.is_file())
    assert "SparkListenerEnvironmentUpdate" in text and "SparkListenerSQLExecutionStart" in text
    return text


def test_a_pipeline_runs_with_its_own_user_and_leaks_no_password(nats_server, tmp_path):
    """The demo's driver logged in as ``pipeline-logs`` (what a launched driver gets) does all its
    work, the server refused it nothing (its grants are enough; tests/isb/test_roles.py shows what
    they refuse), and its password is nowhere in its command line, output, Spark's event log
    (properties, SQL plans) or data dir; nor is the admin's. One run for both checks (a demo run
    costs ~50 CPU-seconds)."""
    admin = nats_server.state.password
    assert admin and _files_holding(admin, nats_server.data_dir / "nats")  # the grep can find it
    demo = DemoRun(nats_server.settings, tmp_path / "data")
    assert grant_pipelines(nats_server.data_dir, [pipeline_grants(demo.p)])
    demo.produce(COUNT)
    demo.settings = resolve_settings(data_dir=nats_server.data_dir, role=pipeline_user("logs"))
    assert demo.env()["NATS_USER"] == "pipeline-logs"
    own = demo.settings.password
    assert own and own != admin and _files_holding(own, nats_server.data_dir / "nats")
    spark_env, events = _event_log_conf(tmp_path)

    result, proc = demo.run(extra_env=spark_env)

    assert result["steps"]["in"]["final_offsets"] == {"src-logs-in": COUNT}
    assert set(demo.raw_ids()) == demo.good_ids(COUNT)
    log = Path(nats_server.state.nodes[0].log).read_text()
    assert "Violation" not in log, [ln for ln in log.splitlines() if "Violation" in ln][:5]
    _check_event_log(events)
    for password in (own, admin):
        assert password not in " ".join(demo.command())
        assert password not in proc.stdout and password not in proc.stderr
        assert _files_holding(password, events, demo.data_dir) == []


@pytest.mark.slow
def test_airflow_batch_dag_leaks_no_password(airflow_home, nats_server, tmp_path):
    password = nats_server.state.password
    folder = tmp_path / "pipelines"
    folder.mkdir()
    shutil.copy(SPEC, folder / "standalone-logs.yaml")
    demo = DemoRun(nats_server.settings, tmp_path / "data", spec=folder / "standalone-logs.yaml")
    demo.produce(COUNT)
    spark_env, events = _event_log_conf(tmp_path)
    env = {"ISBFLOW_HOME": str(demo.data_dir), "ISBFLOW_PIPELINES_DIR": str(folder), "NATS_URL": "",
           "AIRFLOW_CONN_NATS_DEFAULT": nats_connection_json(nats_server.state), **spark_env}

    result = airflow_home.run_dag("pipeline_batch", {"pipeline": "standalone-logs.yaml"}, extra_env=env,
                                  timeout=600)

    assert result.state == "success", result.output[-6000:]
    assert set(demo.raw_ids()) == demo.good_ids(COUNT)
    assert password not in result.output
    _check_event_log(events)
    task_logs = airflow_home.home / "logs"
    assert _files_holding(password, events, demo.data_dir, *([task_logs] if task_logs.exists() else [])) == []


# ---------------------------------------------------------------------------------- injection

def _docs() -> list[dict]:
    return list(yaml.safe_load_all(SPEC.read_text()))


def _set(doc: dict, path: str, value: str) -> None:
    """Set ``a.b[2].c`` in a nested dict/list."""
    node: object = doc
    parts = path.replace("[", ".").replace("]", "").split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]  # type: ignore[index]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value  # type: ignore[index]


#: (document index, where, hostile value, the field path the problem must name)
HOSTILE = [
    (1, "metadata.name", "--master=x", "metadata.name"),
    (1, "spec.vertices[1].name", "a;rm -rf", "vertices[1].name"),
    (1, "spec.vertices[2].udf.references[0].name", "../x", "vertices[2].udf.references[0].name"),
    (1, "spec.vertices[4].sink.delta.path", "../x", "vertices[4].sink.delta.path"),
    (1, "spec.vertices[5].sink.delta.path", "--master=x", "vertices[5].sink.delta.path"),
    (1, "spec.vertices[0].source.jetstream.subject", "a;rm -rf", "vertices[0].source.jetstream.subject"),
    (1, "spec.vertices[1].udf.transform", "os:system;rm", "vertices[1].udf.transform"),
    (1, "spec.interStepBufferServiceName", "../x", "interStepBufferServiceName"),
    (0, "metadata.name", "a;rm -rf", "metadata.name"),
    (0, "spec.jetstream.url", "--master=x", "jetstream.url"),
    (0, "spec.jetstream.url", "nats://h:4222;rm -rf /", "jetstream.url"),
]


@pytest.mark.parametrize(("doc", "where", "value", "field"), HOSTILE,
                         ids=[f"{w}={v}" for _, w, v, _ in HOSTILE])
def test_hostile_spec_values_are_rejected_with_file_and_field(tmp_path, doc, where, value, field):
    docs = _docs()
    _set(docs[doc], where, value)
    spec = tmp_path / "hostile.yaml"
    spec.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    with pytest.raises(SpecError) as e:
        load_specs([spec])
    located = [p for p in e.value.problems if p.path == field]
    assert located, f"no problem names {field}: {[str(p) for p in e.value.problems]}"
    assert all(p.file.endswith("hostile.yaml") for p in e.value.problems)
    assert str(located[0]).startswith(f"{located[0].file}: {field}: ")


def test_launcher_builds_an_argument_list_and_refuses_option_like_masters(tmp_path):
    spec = tmp_path / "a; touch PWNED $(id).yaml"
    cmd = driver_command(spec, data_dir=tmp_path / "d", master="spark://127.0.0.1:7077")
    assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd)
    assert cmd[cmd.index("-f") + 1] == str(spec.absolute())  # one argument, verbatim
    assert cmd[cmd.index("--master") + 1] == "spark://127.0.0.1:7077"
    for master in ("--data-dir=/tmp/x", "-c", "local[2] --conf x=y", "local[2]\n", ""):
        with pytest.raises(LaunchError, match="not a master URL"):
            driver_command(spec, data_dir=tmp_path / "d", master=master)


def test_launch_runs_without_a_shell(tmp_path):
    hostile = ["a; touch PWNED", "$(touch PWNED2)", "`touch PWNED3`", "x && touch PWNED4"]
    code = "import json, sys; print(json.dumps(sys.argv[1:]))"
    record = launch("argv", "argv", [sys.executable, "-c", code, *hostile], data_dir=tmp_path / "d",
                    env={"PATH": "/usr/bin:/bin"}, workdir=tmp_path)
    from isbflow.steps.launch import wait_exit

    assert wait_exit(record, 30)
    import json

    assert json.loads(Path(record.log).read_text().strip().splitlines()[-1]) == hostile
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("PWNED")]


def test_no_module_runs_a_shell():
    """Every process isbflow starts gets an argument list: no shell=True, os.system or os.popen."""
    offenders = []
    for f in sorted((ROOT / "isbflow").rglob("*.py")):
        tree = parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"):
                offenders.append(f"{f.relative_to(ROOT)}:{node.lineno}: {name}")
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    offenders.append(f"{f.relative_to(ROOT)}:{node.lineno}: shell={ast.unparse(kw.value)}")
    assert offenders == []
