"""Helpers for the fault-injection and recovery tests: setting a pipeline up, producing,
running it (in-process or as a detached driver), injecting faults, and the sink checks.

The sink checks every scenario ends with:

- :func:`assert_raw_exact`: a raw sink holds exactly the expected ``_isb_id`` s,
  none twice;
- :func:`assert_aggregates_match`: an aggregate sink equals a batch
  recomputation, by the pipeline's own window transform, of the records in the
  raw sink (which :func:`assert_raw_exact` has proved equal to the source
  records minus the dead letters): every window, open ones included, for a sink
  fed by a ``udf.output: update`` step.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from deltalake import DeltaTable

from isbflow.isb import provision, reference
from isbflow.isb import state as st
from isbflow.isb.connect import NatsSettings, connect
from isbflow.isb.dlq import read_dead_letters
from isbflow.isb.server import NodeState, nats_dir, nats_server_binary, read_state
from isbflow.ops.produce import is_malformed, produce
from isbflow.spec import Specs, load_specs
from isbflow.spec.models import Pipeline
from isbflow.steps.drain import drain_pipeline
from isbflow.steps.launch import launch_pipeline, wait_exit
from isbflow.steps.runner import PipelineRunner

ROOT = Path(__file__).resolve().parents[2]
SPECS = Path(__file__).resolve().parents[2] / "tests" / "specs"
SEED = 7
#: the demo's window transform (spark_apps/logs.py)
WINDOW_TRANSFORM = "spark_apps.logs:per_minute"


# ----------------------------------------------------------------------------- setup and producing


def setup(settings: NatsSettings, spec_path: Path, *, references: bool = True) -> tuple[Specs, Pipeline]:
    """Provision the spec's pipeline; put the demo's ``services`` reference table when it uses one."""
    specs = load_specs(spec_path)
    p = specs.only_pipeline()
    asyncio.run(provision.apply(settings, specs))
    if references and any(v.udf and v.udf.references for v in p.spec.vertices):
        rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
        asyncio.run(reference.put(settings, p.name, "services", rows))
    return specs, p


def publish(settings: NatsSettings, p: Pipeline, count: int, start: int = 0,
            malformed_every: int | None = None, rate: float | None = None) -> None:
    """Events ``start .. start+count-1`` of :data:`SEED`, acked; every one must be stored anew."""
    r = asyncio.run(produce(settings, p, count=count, seed=SEED, start=start, malformed_every=malformed_every,
                            rate=rate))
    assert (r.published, r.duplicates) == (count, 0), r.to_json()


def expected_ids(published: int, bad_seqs: set[int] = frozenset(), source: str = "in") -> set[str]:
    """``_isb_id`` s of source sequences ``1..published`` except ``bad_seqs`` (dead letters)."""
    return {f"{source}/0/{s}" for s in range(1, published + 1) if s not in bad_seqs}


def malformed_seqs(start_seq: int, start: int, count: int, every: int | None) -> set[int]:
    """Source sequences of the malformed events of one :func:`publish` run of events
    ``start .. start+count-1`` whose first event landed at sequence ``start_seq``."""
    return {start_seq + i - start for i in range(start, start + count) if is_malformed(i, every)}


class Producer(threading.Thread):
    """Publishes events ``start, start+1, ...`` at ``rate`` (one :func:`publish` of ``rate`` events
    a second, every ``malformed_every``-th malformed) until :meth:`stop`; ``published`` counts what
    it published (the whole chunk that runs when stopped included), ``error`` what made it fail."""

    def __init__(self, settings: NatsSettings, p: Pipeline, start: int, rate: int, malformed_every: int | None = None):
        super().__init__(daemon=True)
        self.settings, self.p, self.start_at, self.rate, self.every = settings, p, start, rate, malformed_every
        self.published = 0
        self.error: BaseException | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                publish(self.settings, self.p, self.rate, start=self.start_at + self.published,
                        malformed_every=self.every, rate=self.rate)
                self.published += self.rate
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            self.error = e

    def stop(self, timeout: float) -> int:
        self.stopped.set()
        self.join(timeout)
        assert not self.is_alive(), "the producer did not stop"
        assert self.error is None, f"the producer failed: {self.error!r}"
        return self.published


def in_flight(query: Path) -> list[int]:
    """Batch ids whose offsets the query's checkpoint logged but never committed (running now, or
    when its driver was killed)."""
    def ids(sub: str) -> set[int]:
        return {int(f.name) for f in (query / sub).glob("[0-9]*")} if (query / sub).is_dir() else set()

    return sorted(ids("offsets") - ids("commits"))


def relaunch_and_drain(spec: Path, data_dir: Path, settings: NatsSettings, p: Pipeline, killed, source: str,
                       published: int, timeout: float = 300.0):
    """After ``killed`` (a launch record) was killed: launch the driver again on the same checkpoints,
    wait until its source step has committed ``published`` events of stream ``source``, drain the
    pipeline (every step ``drained``) and wait for the driver to exit; the new launch record."""
    again = launch_pipeline(spec, data_dir, settings, workdir=ROOT)
    assert not again.reused and again.pid != killed.pid
    wait_for(lambda: committed(settings, p, "in", source) >= published, timeout,
             lambda: f"the restarted driver to read every event: {driver_report(settings, p, again)}")
    final = drain(settings, p, timeout=300)
    assert {v: s.state for v, s in final.items()} == {v: "drained" for v in p.topological_order()}
    assert wait_exit(again, 120), f"the driver did not exit after draining (log {again.log})"
    return again


# ----------------------------------------------------------------------------- small tools


def wait_for(pred: Callable[[], Any], timeout: float, what: str | Callable[[], str], every: float = 0.5) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); fail naming ``what`` after
    ``timeout`` (a callable ``what`` is asked then: what the pipeline looked like at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what() if callable(what) else what}")
        time.sleep(every)


def driver_report(settings: NatsSettings, p: Pipeline, rec) -> str:
    """What a detached driver was doing: whether it runs, each step's state, batch, commits,
    restarts and error, and its log's tail (what a failed wait on it prints)."""
    try:
        got = statuses(settings, p)
        steps = "\n".join(f"  {v}: " + ("no status" if s is None else
                                       f"{s.state} batch {s.batch_id} committed {s.committed} restarts "
                                       f"{s.restarts} age {time.time() - s.updated_at:.0f}s error {s.error}")
                          for v, s in got.items())
    except Exception as e:  # noqa: BLE001 - a report, never the failure itself
        steps = f"  (statuses unreadable: {e!r})"
    return f"driver pid {rec.pid} alive {rec.alive()}, log {rec.log}\n{steps}\n--- log tail\n{rec.log_tail(40)}"


async def _with_nc(settings: NatsSettings, fn):
    nc = await connect(settings, name="isbflow-tests")
    try:
        return await fn(nc)
    finally:
        await nc.close()


def delete_stream(settings: NatsSettings, stream: str) -> None:
    async def go(nc):
        await nc.jetstream().delete_stream(stream)

    asyncio.run(_with_nc(settings, go))


def statuses(settings: NatsSettings, p: Pipeline) -> dict[str, st.StepStatus | None]:
    return asyncio.run(_with_nc(settings, lambda nc: st.all_status(nc, p.name, p.topological_order())))


def committed(settings: NatsSettings, p: Pipeline, vertex: str, stream: str) -> int:
    """The last sequence of ``stream`` that step ``vertex`` has committed (0: none yet)."""
    got = asyncio.run(_with_nc(settings, lambda nc: st.get_committed(nc, p.name, vertex, stream)))
    return got or 0


def drain(settings: NatsSettings, p: Pipeline, timeout: float = 300.0,
          on_update: Callable[[dict], None] | None = None) -> dict[str, st.StepStatus]:
    return asyncio.run(_with_nc(settings, lambda nc: drain_pipeline(nc, p, timeout=timeout, on_update=on_update)))


def dead_letters(settings: NatsSettings, p: Pipeline) -> list[dict]:
    return asyncio.run(read_dead_letters(settings, p.name))


def run_available_now(spark, specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path,
                      only: list[str] | None = None) -> dict[str, st.StepStatus]:
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    try:
        return runner.run_available_now(only=only)
    finally:
        runner.close()


class ContinuousRun:
    """The pipeline's steps running continuously in threads of this process (the tests' SparkSession).

    ``staggered`` (default): one runner per step, started in topological order, each once the
    queries of the one before are past start-up. Spark gives the Python process behind each
    streaming Python source a fixed 10 s to connect back; a pipeline's queries all started at
    once on a loaded 2-core machine miss it (the runner retries only a few times).
    ``staggered=False``: one runner for the whole pipeline, the shape of one driver.
    ``result`` holds ``"error"`` (the first runner's exception) or ``"out"`` (every step's status).
    """

    def __init__(self, spark, specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path,
                 processing_time: str = "500 milliseconds", staggered: bool = True, startup_timeout: float = 300.0):
        groups: list[list[str] | None] = [[v] for v in p.topological_order()] if staggered else [None]
        self.runners = [(PipelineRunner(spark, specs, p, settings, data_dir, processing_time=processing_time), g)
                        for g in groups]
        self.result: dict[str, Any] = {}
        self.threads = [threading.Thread(target=self._run, args=(r, g), daemon=True,
                                         name=f"isbflow-{p.name}-{'-'.join(g or ['all'])}") for r, g in self.runners]
        self.startup_timeout = startup_timeout

    def _run(self, runner: PipelineRunner, only: list[str] | None) -> None:
        try:
            out = runner.run_continuous(only=only, poll=0.3)
            self.result.setdefault("out", {}).update(out)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            self.result.setdefault("error", e)

    @staticmethod
    def _started(runner: PipelineRunner, only: list[str] | None) -> bool:
        vertices = only or runner.steps()
        if not all(v in runner.runs for v in vertices):
            return False
        return all(rq.query.isActive and not str(rq.query.status.get("message", "")).startswith("Initializing")
                   for v in vertices for rq in runner.runs[v].queries)

    def __enter__(self) -> ContinuousRun:
        for (runner, only), t in zip(self.runners, self.threads, strict=True):
            t.start()
            wait_for(lambda r=runner, o=only, t=t: "error" in self.result or not t.is_alive() or self._started(r, o),
                     self.startup_timeout, f"the queries of {only or 'the pipeline'} to start", every=0.3)
        return self

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        alive = [t.name for t in self.threads if t.is_alive()]
        assert not alive, f"runner(s) {alive} did not stop within {timeout:.0f}s"

    def __exit__(self, *exc) -> None:
        for runner, _ in self.runners:
            runner.stop_all()
        for t in self.threads:
            t.join(60)
        for runner, _ in self.runners:
            runner.close()


# ----------------------------------------------------------------------------- processes


class SaturatedCores:
    """A bounded local CPU load: ``per_core`` busy Python loops per core at normal priority, each
    ending by itself after ``limit_s`` and stopped by PID on exit. What a recovery meets when a
    continuous run shares the machine (load average several times the core count)."""

    def __init__(self, limit_s: float = 120.0, per_core: int = 2):
        self.limit_s, self.count = limit_s, per_core * (os.cpu_count() or 1)
        self.procs: list[subprocess.Popen] = []
        self.busy_s = 0.0
        self.wall_s = 0.0
        self.machine_share = 0.0

    def __enter__(self) -> SaturatedCores:
        loop = f"import time\nend = time.monotonic() + {self.limit_s}\nwhile time.monotonic() < end: pass\n"
        self.procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(self.count)]
        self._t0 = time.monotonic()
        self._stat0 = _cpu_ticks()
        return self

    def __exit__(self, *exc) -> None:
        import psutil

        self.wall_s = time.monotonic() - self._t0
        busy, total = (b - a for a, b in zip(self._stat0, _cpu_ticks(), strict=True))
        self.machine_share = busy / total if total > 0 else 0.0
        for proc in self.procs:
            try:
                times = psutil.Process(proc.pid).cpu_times()
                self.busy_s += times.user + times.system
            except psutil.NoSuchProcess:
                pass
            proc.kill()
            proc.wait(timeout=10)

    def check(self) -> None:
        """The machine was loaded while the loops ran (the work under test competed for its cores):
        its cores were busy at least 75% of the time (``/proc/stat``), and the loops themselves ran
        (with other load beside them they take less of it, which loads the machine no less)."""
        share = self.busy_s / max(self.wall_s * (os.cpu_count() or 1), 1e-9)
        assert self.machine_share > 0.75 and share > 0.05, (
            f"the load generator did not load the machine: the cores were busy {self.machine_share:.0%} "
            f"of {self.wall_s:.1f} s; the loops took {self.busy_s:.1f} CPU s ({share:.0%} of {os.cpu_count()} cores)")


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every core since boot, from ``/proc/stat``'s ``cpu`` line."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is counted in user already
    return total - idle, total


def kill_group(pid: int) -> None:
    """SIGKILL a detached driver's whole process group (driver, JVM, Python workers), and reap it."""
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid  # not our child: gone once /proc says so
            if not Path(f"/proc/{pid}").exists():
                return
        if done == pid:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still there 30 s after SIGKILL")


def kill_node(data_dir: Path, name: str) -> NodeState:
    """SIGKILL one node of an embedded cluster (by its recorded PID); returns its record."""
    state = read_state(data_dir)
    assert state is not None, f"no embedded server under {data_dir}"
    node = next(n for n in state.nodes if n.name == name)
    os.kill(node.pid, signal.SIGKILL)
    try:
        os.waitpid(node.pid, 0)
    except ChildProcessError:
        pass
    return node


def restart_node(data_dir: Path, name: str, timeout: float = 60.0) -> None:
    """Start a killed node again on its own config, data and ports, and record its new PID
    (so the fixture stops it by PID at teardown); wait until it reports healthy."""
    import urllib.request

    state = read_state(data_dir)
    assert state is not None
    node = next(n for n in state.nodes if n.name == name)
    fd = os.open(node.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as logf:
        proc = subprocess.Popen([nats_server_binary(), "-c", node.config], stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    node.pid = proc.pid
    path = nats_dir(data_dir) / "state.json"
    path.write_text(json.dumps(state.to_json(with_secrets=False), indent=2))

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    wait_for(healthy, timeout, f"nats-server {name} to be healthy again (log {node.log})", every=0.2)


def stream_leader(settings: NatsSettings, stream: str) -> str:
    async def go(nc):
        info = await nc.jetstream(timeout=30.0).stream_info(stream)
        return info.cluster.leader

    return asyncio.run(_with_nc(settings, go))


def replicas_current(settings: NatsSettings, streams: list[str]) -> bool:
    """Every replica of every stream is current (caught up with its leader)."""
    async def go(nc):
        js = nc.jetstream()
        for s in streams:
            info = await js.stream_info(s)
            peers = info.cluster.replicas or []
            if not info.cluster.leader or len(peers) < 2 or not all(r.current for r in peers):
                return False
        return True

    try:
        return asyncio.run(_with_nc(settings, go))
    except Exception:  # noqa: BLE001 - a node still electing: not current yet
        return False


# ----------------------------------------------------------------------------- sink checks


def sink_path(data_dir: Path, p: Pipeline, vertex: str) -> Path:
    v = p.vertex(vertex)
    assert v.sink is not None
    path = Path(v.sink.delta.path)
    return path if path.is_absolute() else Path(data_dir) / path


def assert_raw_exact(path: Path, expected: set[str]) -> int:
    """The raw sink holds exactly ``expected`` (its count equals the produced range less the
    dead letters) and no ``_isb_id`` twice; returns its row count."""
    ids = DeltaTable(str(path)).to_pyarrow_table(columns=["_isb_id"]).column("_isb_id").to_pylist()
    dupes = len(ids) - len(set(ids))
    assert dupes == 0, f"{path}: {dupes} duplicate _isb_id"
    missing, extra = expected - set(ids), set(ids) - expected
    assert not missing and not extra, (
        f"{path}: {len(ids)} rows, expected {len(expected)}; missing {len(missing)} (e.g. {sorted(missing)[:5]}), "
        f"unexpected {len(extra)} (e.g. {sorted(extra)[:5]})")
    return len(ids)


def _key(ws: datetime, service: str) -> tuple[datetime, str]:
    return ws.replace(tzinfo=None), service


def assert_aggregates_match(spark, raw_path: Path, agg_path: Path, *, transform: str = WINDOW_TRANSFORM) -> int:
    """The aggregate sink at ``agg_path`` equals a batch recomputation of the records in the raw
    sink at ``raw_path`` by ``transform`` (the pipeline's own window step, run as a batch: its
    watermark does nothing there), over every window; returns how many windows it holds.

    The sinks of these scenarios are fed by ``udf.output: update`` steps (upserted on their
    keys), so the stream result must be the batch result exactly:

    - the same set of windows (window start, group key): none missing, open ones included,
      none extra, none twice;
    - in each, ``window_end``, ``count``, ``errors`` and ``latency_p95`` equal, ``latency_avg``
      to 1e-9 relative (a float mean summed in another order).
    """
    from isbflow.steps.runner import load_transform

    raw = DeltaTable(str(raw_path)).to_pyarrow_table()
    assert raw.num_rows, f"{raw_path}: the raw sink is empty"
    # Spark takes the Arrow table as it is; timestamps stay UTC (the session's time zone)
    recomputed = load_transform(transform)(spark.createDataFrame(raw)).toArrow().to_pylist()
    want = {_key(r["window_start"], r["service"]): r for r in recomputed}
    assert (Path(agg_path) / "_delta_log").exists(), f"{agg_path}: no aggregate table"
    held = DeltaTable(str(agg_path)).to_pyarrow_table().to_pylist()
    got = {_key(r["window_start"], r["service"]): r for r in held}
    assert len(got) == len(held), f"{agg_path}: {len(held) - len(got)} window(s) twice"
    extra = sorted(set(got) - set(want))
    assert not extra, f"{agg_path}: {len(extra)} window(s) no raw record makes, e.g. {extra[:5]}"
    lacking = sorted(set(want) - set(got))
    assert not lacking, f"{agg_path}: {len(lacking)} of {len(want)} window(s) missing, e.g. {lacking[:5]}"
    for k, row in got.items():
        w = want[k]
        assert (row["window_end"], row["count"], row["errors"], row["latency_p95"]) == (
            w["window_end"], w["count"], w["errors"], w["latency_p95"]), (
            f"{agg_path}: window {k}: sink {row['count']} rows / {row['errors']} errors / p95 "
            f"{row['latency_p95']}, recomputed {w['count']} / {w['errors']} / {w['latency_p95']}")
        assert math.isclose(row["latency_avg"], w["latency_avg"], rel_tol=1e-9), (k, row, w)
    return len(got)
