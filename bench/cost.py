"""Cost benchmark (issue #15): what the demo pipeline costs at the rates people run, against its floors.

    python bench/cost.py [--quick] [--rates 100,1000,10000] [--window 120] [--warmup 30] [--settle 420]
                         [--trigger '1 second'] [--idle 60] [--idle-quiet 30] [--curve 0.2,1,5]
                         [--floors rate,python,python_io] [--out bench/results/cost.json]

Starts its own embedded nats-server (temporary data dir, stopped by PID at the end) and
``pipelines/logs.yaml`` (every step) as a detached driver, launched like ``isbflow pipeline
start`` (:func:`isbflow.ops.pipeline.start`), with the spec's trigger (``limits.readTimeout``,
default 5 s; the steps after the source are event-driven) unless ``--trigger`` overrides it. A producer publishes each rate in turn
(ascending; one driver for all rates); per rate, after ``--warmup`` seconds (the first rate:
after every query has committed a batch and what was produced meanwhile is in the raw sink,
then ``--settle`` seconds more and the warm-up: a JVM's JIT compiles for minutes, and the demo
measured 205, 159, 136 and 138 CPU ms a micro-batch in 2-minute windows from minute 1, 4, 7
and 10 of one run), a measured window of ``--window``
seconds records:

- ``cpu_s``: CPU seconds (user + system, reaped children included) of the driver's whole
  process tree (the driver Python, the Spark JVM, its Python workers and runners), from ``/proc``;
  ``cores``: ``cpu_s`` over the window; ``cpu_s_per_1000_events`` (events: what the producer had
  acknowledged in the window) and ``cpu_ms_per_batch`` (micro-batches: the growth of every
  query's checkpoint ``commits/``);
- mean and peak ``pss_bytes`` / ``rss_bytes`` of the tree and the load average (sampled);
- end-to-end latency ``latency_p50_s`` / ``latency_p99_s``: every row the raw sink committed in
  the window, from its publish time (the producer publishes 1 s chunks at the rate and records
  when each chunk's first and last message were acknowledged; a row's ``_isb_id`` is its source
  stream sequence, its publish time is interpolated within its chunk) to the mtime of the Delta
  log entry that made it visible (same host clock);
- ``kept_up``: the raw sink gained at least 90% of the window's events.

After the rates, the idle window (``--idle`` seconds, default 60; none with ``--quick``): the
producer paused, 30 s (``--idle-quiet``) for the last events to pass and the runner to go quiet, then ``idle``:
the tree's ``cores`` and PSS with nothing to do, against the issue's 3% of a core.

Then, in a child process (its own SparkSession, :func:`isbflow.steps.session.spark_session`
as the driver has), the floors at each rate (``--floors``): as many queries as the demo has, each reading
the rate with the same trigger: Spark's built-in ``rate`` source (``rowsPerSecond``) into ``noop``
(``rate``); :class:`CounterSource`, a trivial Python ``DataSourceStreamReader`` in
``bench/cost_floors.py`` (one partition, rows from a counter), into ``noop`` (``python``) and into
:class:`NullSink`, a trivial Python streaming sink (``python_io``: every query of the demo reads and
writes through Python, so this is the least such a query costs); the same figures from the child's tree (its micro-batches from each
query's progress) and Spark's per-batch ``durationMs`` summed per phase. ``ratios``: the demo's
CPU per micro-batch over each floor's. ``--curve`` runs the demo again at 100 events/s
(``--curve-rate``) for each trigger interval (seconds), relaunching the driver each time.
Targets are reported (``met`` / ``missed`` with the bound), never asserted; the machine is
shared, so only ratios within one run and the load average beside them mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# the floors' Python source (bench/cost_floors.py) is imported by Spark's Python workers
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(BENCH), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

import _common as cm  # noqa: E402
import cost_profile  # noqa: E402
from _common import log  # noqa: E402
from soak import batches_per_query, cpu_seconds, tree_cpu_seconds  # noqa: E402

SPEC = ROOT / "pipelines" / "logs.yaml"
#: the floors ``--floors`` chooses from (``bench/cost_floors.py``'s ``FORMATS``)
FLOOR_KINDS = ("rate", "python", "python_io")
GIB = 1 << 30
KEPT_UP = 0.9
#: seconds the pipeline may take to commit a first batch in every query (Spark's start on a loaded machine)
STARTUP_S = 900.0
#: launches of the driver before the run gives up on a start-up
LAUNCHES = 5
#: seconds between pausing the producer and the idle window: the last events pass through and the
#: runner goes quiet (``isbflow.steps.runner.QUIET_AFTER_S``, 10 s, after the last batch)
IDLE_QUIET_S = 30.0


# ------------------------------------------------------------------ sampling


class Sampler:
    """Every ``every`` seconds: PSS/RSS of a process tree and the 1-minute load average."""

    def __init__(self, root: int, every: float):
        self.root, self.every = root, every
        self.samples: list[dict] = []
        #: CPU seconds this sampler's thread spent (reading ``smaps_rollup`` of every process costs the
        #: reader kernel time): taken out of a window whose tree holds the sampler (the floors')
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cost-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.thread_time()
        while True:
            tree = cm.descendants(self.root)
            self.samples.append({**cm.tree_memory(tree), "load1": os.getloadavg()[0], "processes": len(tree)})
            self.cpu_s = time.thread_time() - start
            if self._stop.wait(self.every):
                return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        s = self.samples or [{"pss_bytes": 0, "rss_bytes": 0, "load1": 0.0, "processes": 0}]
        out = {}
        for k in ("pss_bytes", "rss_bytes"):
            out[f"{k[:3]}_mean_bytes"] = int(sum(x[k] for x in s) / len(s))
            out[f"{k[:3]}_peak_bytes"] = max(x[k] for x in s)
        out["load_average_mean"] = round(sum(x["load1"] for x in s) / len(s), 2)
        out["processes_max"] = max(x["processes"] for x in s)
        out["sampler_cpu_s"] = round(self.cpu_s, 3)
        return out


def spark_trigger(seconds: float) -> str:
    return f"{round(seconds * 1000)} milliseconds"


def window_figures(cpu_s: float, seconds: float, events: int, batches: int) -> dict:
    return {"seconds": round(seconds, 2), "events": events, "batches": batches, "cpu_s": round(cpu_s, 2),
            "cores": round(cpu_s / seconds, 4) if seconds > 0 else None,
            "cpu_s_per_1000_events": round(cpu_s * 1000 / events, 4) if events else None,
            "cpu_ms_per_batch": round(cpu_s * 1000 / batches, 2) if batches else None}


# ------------------------------------------------------------------ the demo


class Producer:
    """Publishes ``rate`` events/s in 1 s chunks, recording when each chunk's messages were acknowledged."""

    def __init__(self, settings, p):
        self.settings, self.p = settings, p
        self.rate = 0.0
        self.published = 0
        self.chunks: list[tuple[int, int, float, float]] = []  # (first seq, last seq, t first, t last)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.is_alive() or self.error is not None

    def start(self, rate: float) -> Producer:
        self.rate = rate
        self._thread.start()
        return self

    def _run(self) -> None:
        import asyncio

        from isbflow.ops.produce import produce

        async def loop():
            while not self._stop.is_set():
                rate = self.rate
                if rate <= 0:  # paused (the idle window)
                    await asyncio.sleep(0.2)
                    continue
                n = max(1, int(rate))
                t0 = time.time()
                rep = await produce(self.settings, self.p, count=n, rate=rate, seed=cm.SEED, start=self.published)
                if rep.published:
                    self.chunks.append((self.published + 1, self.published + rep.published, t0, time.time()))
                self.published += rep.published

        try:
            asyncio.run(loop())
        except BaseException as e:  # noqa: BLE001 - reported by the run
            self.error = e

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def publish_times(self, seqs):
        """Each source sequence's publish time, interpolated within its chunk (numpy array)."""
        import numpy as np

        xs, ts = [], []
        for lo, hi, t0, t1 in self.chunks:
            xs += [lo - 0.5, hi + 0.5]
            ts += [t0, t1]
        return np.interp(seqs, xs, ts)


def sink_latencies(table: Path, producer: Producer, t0: float, t1: float) -> list[float]:
    """Visible minus publish time of every row the Delta table ``table`` committed in ``[t0, t1]``."""
    from urllib.parse import unquote

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out = []
    for c in cm.delta_commits(str(table)):
        if not t0 <= c["visible_s"] <= t1 or not c["adds"]:
            continue
        for add in c["adds"]:
            ids = pq.read_table(table / unquote(add), columns=["_isb_id"]).column("_isb_id")
            seqs = pc.cast(pc.utf8_slice_codeunits(ids, 5), "int64").to_numpy()
            out.extend((c["visible_s"] - producer.publish_times(seqs)).tolist())
    return sorted(out) if out else []


def sink_rows_at(table: Path, t: float) -> int:
    """Rows the Delta table ``table`` held at wall time ``t`` (its commits' add stats up to then)."""
    rows = 0
    for c in cm.delta_commits(str(table)):
        if c["visible_s"] > t:
            break
        for line in (table / "_delta_log" / f"{c['version']:020d}.json").read_text().splitlines():
            add = json.loads(line).get("add")
            if add and add.get("stats"):
                rows += json.loads(add["stats"]).get("numRecords", 0)
    return rows


def demo_window(work: Path, record, producer: Producer, pipeline: str, raw: Path, seconds: float,
                sample_every: float) -> dict:
    """One measured window of the running driver (module docstring)."""
    tree = cm.descendants(record.pid)
    sampler = Sampler(record.pid, sample_every)
    t0, cpu0, b0, e0 = time.time(), tree_cpu_seconds(tree), batches_per_query(work, pipeline), producer.published
    split0 = cost_profile.cpu_snapshot(tree)
    la0 = os.getloadavg()
    time.sleep(seconds)
    tree = cm.descendants(record.pid)
    t1, cpu1, b1, e1 = time.time(), tree_cpu_seconds(tree), batches_per_query(work, pipeline), producer.published
    split1 = cost_profile.cpu_snapshot(tree)
    mem = sampler.stop()
    if record.alive() is False:
        raise RuntimeError(f"the driver exited; its log {record.log}:\n{record.log_tail()}")
    per_query = {q: n - b0.get(q, 0) for q, n in b1.items()}
    out = window_figures(cpu1 - cpu0, t1 - t0, e1 - e0, sum(per_query.values()))
    lat = sink_latencies(raw, producer, t0, t1)
    gained = sink_rows_at(raw, t1) - sink_rows_at(raw, t0)
    out.update(mem, batches_per_query=per_query, queries=len(per_query), sink_rows=gained,
               kept_up=bool(out["events"]) and gained >= KEPT_UP * out["events"],
               batches_per_query_per_s=round(min(per_query.values(), default=0) / (t1 - t0), 3),
               latency_rows=len(lat), latency_p50_s=cm.percentile(lat, 0.5), latency_p99_s=cm.percentile(lat, 0.99),
               load_average_start=list(la0), load_average_end=list(os.getloadavg()),
               where_cpu_goes=cost_profile.cpu_split(split0, split1, out["batches"]))
    return out


def own_cpu_seconds(pids: list[int]) -> dict[int, float]:
    """Each process's own utime + stime. The idle window sums their growth over the processes alive
    at its end, not the tree's total with reaped children (as the rate windows do): in an idle
    window processes exit (Spark ends idle Python workers), a process's time leaves the total when
    it exits and comes back in its parent's only if the parent reaps it, whole lifetime at once
    (the total fell by 2.0 CPU-s over one 60 s idle window). A process that exits within the
    window loses what it spent there (``exited`` counts them)."""
    return {pid: own for pid, (own, _) in cpu_seconds(pids).items()}


def idle_window(record, producer: Producer, seconds: float, sample_every: float, quiet: float = IDLE_QUIET_S) -> dict:
    """The driver with nothing to do: the producer paused, ``quiet`` seconds for what it had
    published to pass through (and the runner to go quiet), then ``seconds`` measured."""
    producer.rate = 0
    log(f"idle: the producer paused; {quiet:g}s to go quiet, then a {seconds:g}s window")
    time.sleep(quiet)
    sampler = Sampler(record.pid, sample_every)
    t0, cpu0 = time.time(), own_cpu_seconds(cm.descendants(record.pid))
    time.sleep(seconds)
    t1, cpu1 = time.time(), own_cpu_seconds(cm.descendants(record.pid))
    cpu = sum(c - cpu0.get(pid, 0.0) for pid, c in cpu1.items())
    out = {"seconds": round(t1 - t0, 2), "cpu_s": round(cpu, 2), "cores": round(cpu / (t1 - t0), 4),
           "exited": len(set(cpu0) - set(cpu1)), **sampler.stop()}
    out["target"] = verdict("cores of the demo idle", out["cores"], 0.03)
    log(f"idle: {out['cores']} cores, pss {out['pss_mean_bytes'] >> 20} MiB ({out['target']['verdict']})")
    return out


def wait_backlog(raw: Path, producer: Producer, record, most: float = STARTUP_S) -> float:
    """Seconds until the raw sink holds what was produced while the driver started (the start-up's
    backlog: a window over it would measure catching up, not the rate); at most ``most``."""
    t0 = time.time()
    target = producer.published
    while time.time() - t0 < most and record.alive() is not False:
        if cm.sink_rows(str(raw)) >= target:
            break
        time.sleep(2)
    log(f"the start-up's backlog ({target} events) is in the raw sink after {time.time() - t0:.0f}s")
    return round(time.time() - t0, 1)


def launch_and_wait(args, specs, p, settings, work: Path, trigger: str | None, provision: bool,
                    producer: Producer, rate: float):
    """The detached driver, once every query has committed a first batch (relaunched at most
    :data:`LAUNCHES` - 1 times when it exits before that: a query out of restarts while the loaded
    machine could not start its Python workers within Spark's 10 s); the producer starts
    at ``rate`` once the buffers are provisioned."""
    from isbflow.ops import pipeline as ops
    from isbflow.steps.launch import stop_launch

    for attempt in range(LAUNCHES):
        env = {"SPARK_CONF_DIR": str(args.spark_conf_dir)} if args.spark_conf_dir else None
        record = ops.start(SPEC, specs, p, settings, work, workdir=ROOT, provision=provision and attempt == 0,
                           references_dir=SPEC.parent / ops.REFERENCE_DIR, processing_time=trigger,
                           progress=log, env=env).launch
        log(f"driver pid {record.pid} (trigger {trigger or 'the spec'}), log {record.log}")
        producer.rate = rate
        if not producer.started:
            producer.start(rate)
        deadline = time.time() + STARTUP_S
        while time.time() < deadline and record.alive() is not False:
            q = batches_per_query(work, p.name)
            if len(q) >= len(p.spec.vertices) and all(q.values()):  # one query per vertex
                return record
            time.sleep(2)
        if record.alive() is not False:  # still running: out of time
            stop_launch(work, record.key, grace=20)
            raise RuntimeError(f"some query committed no batch in {STARTUP_S:.0f}s; see {record.log}")
        log(f"the driver exited before every query committed a batch: {record.log_tail(3)}")
    raise RuntimeError(f"the driver exited {LAUNCHES} times before every query committed a batch: {record.log_tail()}")


def run_demo(args, result: dict) -> int:
    """Every rate, then the curve; returns the demo's number of queries."""
    from isbflow.isb.connect import resolve_settings
    from isbflow.isb.server import start_embedded, stop_embedded
    from isbflow.ops.sinks import sink_table_path
    from isbflow.spec import load_specs
    from isbflow.steps.launch import stop_launch

    work = Path(tempfile.mkdtemp(prefix="isbflow-bench-cost-"))
    specs = load_specs(SPEC)
    p = specs.only_pipeline()
    raw = Path(sink_table_path(p, "raw", work))
    nats_started, record, producer = False, None, None
    queries, t_start = 0, time.time()
    args.spark_conf_dir = cost_profile.progress_conf_dir() if args.profile else None
    try:
        start_embedded(work)
        nats_started = True
        settings = resolve_settings(data_dir=work)
        producer = Producer(settings, p)
        trigger = spark_trigger(args.trigger) if args.trigger else None
        record = launch_and_wait(args, specs, p, settings, work, trigger, True, producer, args.rates[0])
        result["startup_s"] = round(time.time() - t_start, 1)
        result["backlog_s"] = wait_backlog(raw, producer, record)
        for i, rate in enumerate(args.rates):
            producer.rate = rate
            warm = args.warmup + (args.settle if i == 0 else 0.0)
            log(f"demo at {rate:g} events/s: warm-up {warm:g}s, window {args.window:g}s")
            time.sleep(warm)
            w = demo_window(work, record, producer, p.name, raw, args.window, args.sample_every)
            if producer.error is not None:
                raise RuntimeError(f"the producer failed: {producer.error!r}")
            result["rates"].append({"rate": rate, "demo": w})
            if args.profile:
                t1 = time.time()
                w["duration_ms_per_batch"] = cost_profile.phase_means(
                    cost_profile.progress_from_log(record.log, t1 - args.window, t1))
                log(f"py-spy on the driver tree's Python processes for {args.profile:g}s")
                w["pyspy"] = cost_profile.pyspy_top(cm.descendants(record.pid), args.profile)
            queries = w["queries"]
            log(f"demo {rate:g}/s: {w['cores']} cores, {w['cpu_ms_per_batch']} ms/batch, "
                f"p50 {w['latency_p50_s']} s, pss {w['pss_mean_bytes'] >> 20} MiB, load {w['load_average_mean']}")
        if args.idle:
            result["idle"] = idle_window(record, producer, args.idle, args.sample_every, args.idle_quiet)
        for trig in args.curve:
            result["harness_cpu_s"]["drivers"] += tree_cpu_seconds(cm.descendants(record.pid))
            stop_launch(work, record.key, grace=20)
            record = launch_and_wait(args, specs, p, settings, work, spark_trigger(trig), False, producer,
                                     args.curve_rate)
            wait_backlog(raw, producer, record)
            time.sleep(args.warmup)
            w = demo_window(work, record, producer, p.name, raw, args.window, args.sample_every)
            result["curve"].append({"trigger_s": trig, "rate": args.curve_rate, "demo": w})
            log(f"curve {trig:g}s: {w['cores']} cores, p50 {w['latency_p50_s']} s")
    finally:
        if record is not None and record.alive():
            result["harness_cpu_s"]["drivers"] += tree_cpu_seconds(cm.descendants(record.pid))
        cm.undo_all((("producer", producer and producer.stop),
                     ("driver", record and (lambda: stop_launch(work, record.key, grace=20))),
                     ("nats-server", nats_started and (lambda: stop_embedded(work)))))
        shutil.rmtree(work, ignore_errors=True)
        if args.spark_conf_dir:
            shutil.rmtree(args.spark_conf_dir, ignore_errors=True)
    return queries


# ------------------------------------------------------------------ the floors (child process)


def spec_trigger_s() -> float:
    """The demo's source trigger when ``--trigger`` is not given: the spec's ``readTimeout``
    (default 5 s); the floors run at the same interval."""
    from isbflow.spec import constants, load_specs

    p = load_specs(SPEC).only_pipeline()
    source = next(v for v in p.spec.vertices if v.source)
    return source.effective_limits(p.spec.limits).readTimeout or constants.READ_TIMEOUT_S


def run_floors(args, queries: int) -> dict:
    cfg = {"rates": args.rates, "queries": queries, "kinds": args.floors,
           "trigger": spark_trigger(args.trigger or spec_trigger_s()),
           "warmup": args.warmup, "settle": args.settle,
           "window": args.window, "sample_every": args.sample_every}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
        proc = subprocess.run([sys.executable, __file__, "--floors-child", json.dumps(cfg), "--out", f.name],
                              env=env, cwd=ROOT, timeout=STARTUP_S + len(args.floors) * (
                                  args.settle + len(args.rates) * (args.window + 120)))
        if proc.returncode:
            raise RuntimeError(f"the floors' child failed ({proc.returncode})")
        return json.loads(Path(f.name).read_text())


def harness_cpu(result: dict, floors: dict | None) -> None:
    """CPU seconds the whole benchmark cost (drivers, floors' child, this process): the test's budget."""
    import resource

    h = result["harness_cpu_s"]
    h["floors_child"] = round((floors or {}).pop("child_cpu_s", 0.0), 1)
    me = resource.getrusage(resource.RUSAGE_SELF)
    h["bench"] = round(me.ru_utime + me.ru_stime, 1)
    h["drivers"] = round(h["drivers"], 1)
    h["total"] = round(h["drivers"] + h["floors_child"] + h["bench"], 1)


# ------------------------------------------------------------------ figures and targets


def verdict(name: str, value, bound: float, op: str = "<=") -> dict:
    ok = None if value is None else (value <= bound if op == "<=" else value < bound)
    return {"target": name, "value": value, "bound": f"{op} {bound:g}",
            "verdict": "n/a" if ok is None else ("met" if ok else "missed")}


def figures(result: dict, floors: dict, trigger_s: float, cores: int) -> None:
    for r in result["rates"]:
        kinds = list(floors[str(r["rate"])])
        for kind in kinds:
            r[f"floor_{kind}"] = floors[str(r["rate"])][kind]
        d = r["demo"]

        def ratio(floor: dict, key: str, d=d) -> float | None:
            return round(d[key] / floor[key], 2) if d[key] and floor.get(key) else None

        r["ratios"] = {f"{key}_over_{kind}": ratio(r[f"floor_{kind}"], key)
                       for key in ("cpu_ms_per_batch", "cores", "pss_mean_bytes") for kind in kinds}
        if "python" in kinds and "python_io" in kinds:  # what a Python sink adds to the least a query costs
            io, src = r["floor_python_io"]["cpu_ms_per_batch"], r["floor_python"]["cpu_ms_per_batch"]
            r["ratios"]["python_io_floor_over_python_floor"] = round(io / src, 2) if io and src else None
        t = [verdict("CPU per micro-batch / Python source floor", r["ratios"].get("cpu_ms_per_batch_over_python"), 1.5)]
        if r["rate"] <= 100:
            t += [verdict("cores of the demo", d["cores"], 0.5),
                  verdict("end-to-end p50 (s)", d["latency_p50_s"], 5.0),
                  verdict("driver tree mean PSS (GiB)", round(d["pss_mean_bytes"] / GIB, 3), 1.2),
                  verdict("load average (mean of the window) < cores", d["load_average_mean"], cores, "<"),
                  verdict("slowest query's batches/s behind its trigger (1/trigger - rate)",
                          round(1 / trigger_s - d["batches_per_query_per_s"], 3), 0.1)]
        r["targets"] = t


def print_table(r: dict) -> None:
    print(f"\n{'rate':>6} {'who':<9} {'cores':>6} {'CPU s/1k ev':>11} {'ms/batch':>9} {'batches':>7} "
          f"{'PSS mean/peak MiB':>18} {'p50/p99 s':>12} {'load':>5}")
    for x in r["rates"]:
        for who in ("demo", "floor_rate", "floor_python", "floor_python_io"):
            w = x.get(who)
            if not w:
                continue
            lat = f"{w['latency_p50_s']:.2f}/{w['latency_p99_s']:.2f}" if w.get("latency_p50_s") is not None else ""
            print(f"{x['rate']:>6g} {who.removeprefix('floor_'):<9.9} {w['cores']:>6} {w['cpu_s_per_1000_events'] or 0:>11} "
                  f"{w['cpu_ms_per_batch'] or 0:>9} {w['batches']:>7} "
                  f"{w['pss_mean_bytes'] >> 20:>8}/{w['pss_peak_bytes'] >> 20:<9} {lat:>12} {w['load_average_mean']:>5}")
        for t in x.get("targets", []):
            print(f"       {t['target']}: {t['value']} ({t['bound']}) {t['verdict']}")
        for k, v in x.get("ratios", {}).items():
            if k.startswith(("cpu_ms_per_batch_over", "python_io")):
                print(f"       {k}: {v}")
    if r.get("idle"):
        i = r["idle"]
        print(f"idle: {i['cores']} cores, PSS mean {i['pss_mean_bytes'] >> 20} MiB; "
              f"{i['target']['target']} ({i['target']['bound']}) {i['target']['verdict']}")
    for c in r["curve"]:
        w = c["demo"]
        print(f"trigger {c['trigger_s']:g}s at {c['rate']:g}/s: {w['cores']} cores, {w['cpu_ms_per_batch']} ms/batch, "
              f"p50 {w['latency_p50_s']} s, p99 {w['latency_p99_s']} s")


def main() -> None:
    cm.stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one low rate, short windows: checks the harness")
    ap.add_argument("--rates", help="events/s, comma-separated (default 100,1000,10000; quick 100)")
    ap.add_argument("--window", type=float, help="measured seconds per rate (default 120; quick 20)")
    ap.add_argument("--warmup", type=float, help="seconds at a rate before its window (default 30; quick 8)")
    ap.add_argument("--settle", type=float,
                    help="seconds more before the first rate's window, for the demo and each floor: the JVM's "
                         "JIT settling (the demo measured 205, 159, 136, 138 CPU ms a batch in 2-minute windows "
                         "from minute 1, 4, 7 and 10; default 420; quick 0)")
    ap.add_argument("--trigger", type=float, help="seconds: override the source steps' trigger (default: the spec's, 5; the others are event-driven)")
    ap.add_argument("--idle", type=float, help="seconds of the idle window after the rates: the producer paused, "
                                               "--idle-quiet seconds later the driver tree's CPU (default 60; quick 0: none)")
    ap.add_argument("--idle-quiet", type=float, default=IDLE_QUIET_S,
                    help=f"seconds between pausing the producer and the idle window (default {IDLE_QUIET_S:g}: "
                         "the last events pass and the runner goes quiet; less measures part of that)")
    ap.add_argument("--curve", default="", help="trigger intervals in seconds for the curve, e.g. 0.2,1,5")
    ap.add_argument("--curve-rate", type=float, default=100.0)
    ap.add_argument("--no-floors", action="store_true", help="skip the floors")
    ap.add_argument("--floors", help="the floors to measure, comma-separated, of rate (Spark's rate source -> noop), "
                                     "python (a trivial Python source -> noop) and python_io (the trivial Python source "
                                     "-> a trivial Python sink: the least a query that reads and writes through "
                                     "Python data sources costs, as every query of the demo does); default all "
                                     "three, quick rate,python")
    ap.add_argument("--profile", type=float, default=0.0,
                    help="seconds of py-spy after each window; the driver logs every query's progress (INFO) for "
                         "Spark's durationMs per phase, which costs CPU itself: a run of its own")
    ap.add_argument("--sample-every", type=float, default=2.0, help="seconds between memory samples")
    ap.add_argument("--floors-child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(BENCH / "results" / "cost.json"))
    args = ap.parse_args()
    if args.floors_child:
        from cost_floors import floors_child

        Path(args.out).write_text(json.dumps(floors_child(json.loads(args.floors_child))))
        return
    args.rates = [float(x) for x in (args.rates or ("100" if args.quick else "100,1000,10000")).split(",")]
    args.window = args.window or (20.0 if args.quick else 120.0)
    args.warmup = args.warmup if args.warmup is not None else (8.0 if args.quick else 30.0)
    args.settle = args.settle if args.settle is not None else (0.0 if args.quick else 420.0)
    args.curve = [float(x) for x in args.curve.split(",") if x]
    args.floors = [x for x in (args.floors or ("rate,python" if args.quick else "rate,python,python_io")).split(",") if x]
    unknown = sorted(set(args.floors) - set(FLOOR_KINDS))
    if unknown:
        ap.error(f"--floors: unknown floor(s) {', '.join(unknown)}; known: {', '.join(FLOOR_KINDS)}")
    args.idle = args.idle if args.idle is not None else (0.0 if args.quick else 60.0)
    result: dict = {"machine": cm.machine(), "load_average_start": list(os.getloadavg()),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rates": [], "curve": [],
                    "harness_cpu_s": {"drivers": 0.0},
                    "config": {k: getattr(args, k) for k in ("quick", "rates", "window", "warmup", "settle", "trigger", "curve", "idle",
                                                             "curve_rate", "sample_every", "profile", "idle_quiet", "floors")}
                    | {"spec": str(SPEC.relative_to(ROOT)), "master": "local[2]"}}
    floors = None
    try:
        queries = run_demo(args, result)
        result["queries"] = queries
        if not args.no_floors:
            floors = run_floors(args, queries)
            harness_cpu(result, floors)
            figures(result, floors, args.trigger or spec_trigger_s(), os.cpu_count() or 1)
        else:
            harness_cpu(result, None)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        cm.write_result(result, args.out, lambda r: None)
        raise
    finally:
        result["load_average_end"] = list(os.getloadavg())
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    cm.write_result(result, args.out, print_table)


if __name__ == "__main__":
    main()
