"""The runner's autoscaler (isbflow.steps.autoscale_apply) without Spark: its decisions reach the
replicas file the reader plans by, the step's status, the log and the metrics; on a cluster master
it asks for and releases executors through the SparkContext's JVM side (a recording stand-in here;
tests/platform/test_autoscale_standalone.py does it on a real standalone cluster)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import yaml

from isbflow.connector.offsets import replicas
from isbflow.isb.state import StepStatus
from isbflow.spec import load_specs
from isbflow.steps.autoscale_apply import Autoscaler
from isbflow.steps.metrics import PipelineMetrics
from tests.conftest import ROOT

SPEC = ROOT / "tests" / "specs" / "autoscale.yaml"


def _pipeline(tmp_path: Path, **scale):
    docs = list(yaml.safe_load_all(SPEC.read_text()))
    docs[1]["spec"]["vertices"][0]["scale"].update(scale)
    f = tmp_path / "autoscale.yaml"
    f.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return load_specs([f]).only_pipeline()


class _Seq:
    def __init__(self, items):
        self.items = list(items)

    def mkString(self, sep):  # noqa: N802 - Scala's name
        return sep.join(self.items)


class _List(list):
    add = list.append


class _Jvm:
    """What Autoscaler calls on the JVM: the executors registered, the total asked for, kills."""

    def __init__(self, executors: list[str], busy: set[str] = frozenset()):
        self.executors, self.busy, self.totals, self.killed = list(executors), set(busy), [], []
        self.PythonUtils = SimpleNamespace(toScalaMap=lambda m: m, toSeq=lambda ids: list(ids))
        self.java = SimpleNamespace(util=SimpleNamespace(HashMap=dict, ArrayList=_List))

    # SparkContext
    def getExecutorIds(self):  # noqa: N802
        return _Seq(self.executors)

    def requestTotalExecutors(self, n, locality, hosts):  # noqa: N802
        self.totals.append(n)
        return True

    def taskScheduler(self):  # noqa: N802
        return SimpleNamespace(isExecutorBusy=lambda i: i in self.busy)

    def schedulerBackend(self):  # noqa: N802
        def kill(ids, adjust, count_failures, force):
            assert (adjust, count_failures, force) == (False, False, False)
            self.killed += ids
            self.executors = [e for e in self.executors if e not in ids]
            return _Seq(ids)
        return SimpleNamespace(killExecutors=kill)


def _runner(tmp_path: Path, p, master: str, jvm: _Jvm | None = None, dynamic: bool = False):
    jvm = jvm or _Jvm([])
    conf = {"spark.dynamicAllocation.enabled": "true"} if dynamic else {}
    sc = SimpleNamespace(master=master, _jvm=jvm, _jsc=SimpleNamespace(sc=lambda: jvm),
                         getConf=lambda: SimpleNamespace(get=lambda k, default=None: conf.get(k, default)))
    return SimpleNamespace(p=p, data_dir=tmp_path / "data", spark=SimpleNamespace(sparkContext=sc))


def _run(p, status: StepStatus):
    return SimpleNamespace(vertex="in", status=status, queries=[SimpleNamespace(inputs=["src-auto-in"])])


def test_a_backlog_raises_the_task_slots_and_idle_lowers_them_on_a_local_master(tmp_path, caplog):
    p = _pipeline(tmp_path)
    a = Autoscaler(_runner(tmp_path, p, "local[2]"), now=0)
    assert a.executors is None and a.scales("in") and not a.scales("raw")  # raw has no scale
    assert a.reader_options("raw") == {}
    file = a.reader_options("in")["replicasFile"]
    a.start("in", now=0)
    assert replicas(file) == 1
    status = StepStatus("in", state="running", lag={"src-auto-in": 100_000})
    run = _run(p, status)
    caplog.set_level(logging.DEBUG, "isbflow.steps.autoscale_apply")
    a.look(run, now=1)
    status.rows_total = 20_000
    d = a.look(run, now=3)  # 10,000 rows/s, 100,000 pending, targetProcessingSeconds 1: far above max 2
    assert (d.direction, d.current, d.target, d.desired) == ("up", 1, 2, 2)
    assert replicas(file) == 2  # the next batch is planned in two tasks
    assert status.replicas["target"] == 2 and status.replicas["ups"] == 1 and status.replicas["executors"] is None
    assert "autoscale in: up 1 -> 2 (backlog)" in caplog.text and "pending [100000]" in caplog.text
    status.lag = {"src-auto-in": 0}
    d = a.look(run, now=8)  # idle: no rows since t=3 in the 3 s lookback, but the scale-down cooldown is 10 s
    assert (d.direction, d.target, d.why, d.cooldown_left_s) == ("none", 2, "scale-down cooldown", 5.0)
    d = a.look(run, now=14)
    assert (d.direction, d.current, d.target, d.desired) == ("down", 2, 1, 1)
    assert status.replicas["downs"] == 1 and replicas(file) == 1
    assert a.look(run, now=15).direction == "none"

    m = PipelineMetrics(p)
    m.observe(None, SimpleNamespace(vertex="in", queries=[], status=status))  # type: ignore[arg-type]
    get = m.registry.get_sample_value
    labels = {"pipeline": "auto", "step": "in"}
    assert get("isbflow_vertex_current_replicas", labels) == 1
    assert get("isbflow_vertex_desired_replicas", labels) == 1
    assert get("isbflow_vertex_scale_decisions_total", {**labels, "direction": "up"}) == 1
    assert get("isbflow_vertex_scale_decisions_total", {**labels, "direction": "down"}) == 1


def test_on_a_cluster_master_it_asks_for_the_total_and_releases_idle_executors(tmp_path):
    p = _pipeline(tmp_path, scaleDownCooldownSeconds=0)
    jvm = _Jvm(["0", "1"], busy={"1"})
    a = Autoscaler(_runner(tmp_path, p, "spark://127.0.0.1:7077", jvm), now=0)
    a.start("in", now=0)  # the application took both workers' cores: back to min, an idle one released
    assert jvm.totals == [1] and jvm.killed == ["0"] and jvm.executors == ["1"]
    status = StepStatus("in", state="running", lag={"src-auto-in": 50_000})
    run = _run(p, status)
    a.look(run, now=1)
    status.rows_total = 10_000
    a.look(run, now=2)
    assert jvm.totals == [1, 2] and status.replicas["executors"] == {"target": 2, "live": 1}
    jvm.executors.append("2")  # the master started the second executor
    status.lag, status.state = {"src-auto-in": 0}, "drained"
    a.look(run, now=3)  # the step ended: its executors are kept for a step that starts after it
    assert jvm.totals == [1, 2] and jvm.executors == ["1", "2"]


def test_under_dynamic_allocation_the_executors_are_sparks(tmp_path):
    p = _pipeline(tmp_path)
    jvm = _Jvm(["0", "1"])
    a = Autoscaler(_runner(tmp_path, p, "spark://127.0.0.1:7077", jvm, dynamic=True), now=0)
    a.start("in", now=0)
    assert a.executors is None and jvm.totals == [] and jvm.killed == [] and a.reader_options("in")


def test_a_disabled_scale_has_no_autoscaler(tmp_path):
    p = _pipeline(tmp_path, disabled=True)
    jvm = _Jvm(["0", "1"])
    a = Autoscaler(_runner(tmp_path, p, "spark://127.0.0.1:7077", jvm), now=0)
    a.start("in", now=0)
    assert a.executors is None and a.reader_options("in") == {} and jvm.totals == [] and jvm.killed == []
