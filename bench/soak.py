"""Soak benchmark (issue #19 item 2): the demo pipeline, continuous, at a steady rate, for long.

    python bench/soak.py [--quick] [--batches N] [--max-minutes M] [--rate R]
                         [--trigger '200 milliseconds'] [--out bench/results/soak.json] [--keep]

Starts its own embedded nats-server (temporary data dir, stopped by PID at the end), then
``pipelines/logs.yaml`` (every step, its reference table loaded) as a detached driver, the
way the ``pipeline_start`` DAG launches it (:func:`isbflow.ops.pipeline.start`), with the
trigger interval ``--trigger`` (accelerated: more micro-batches per minute than the default
1 second) and its Prometheus endpoint on. The demo producer publishes ``--rate`` events/s
(every ``--malformed-every``-th one malformed, so dead letters and the ledger's folding are
exercised) from the start; the measured run begins when every step has committed a first
micro-batch, and producing stops when every step has committed ``--batches`` micro-batches or
``--max-minutes`` after that, whichever comes first. Every ``--maintain-every`` seconds the sinks are
compacted and vacuumed and their Delta logs bounded (``isbflow sink maintain``, what the
``sink_maintenance`` DAG runs; retentions ``--vacuum-hours``, accelerated to 0 h by default, and
``--log-retention-hours``, accelerated to twice the maintenance interval: the sinks' own commits read
the log while maintenance trims it, and a retention shorter than the interval can delete entries a
commit is about to read (a 0 h soak failed so, "File not found: .../_delta_log/...124.json", the
upsert sink's step stopped); ``--quick`` keeps 0 h so that its 45 s show the log trimmed. The
product's default and floor for both is 168 h).

Every ``--sample-every`` seconds it records (all cumulative counters kept, so any span can be
turned into a rate):

- ``cpu_s``: CPU seconds (user + system, reaped children included) of the driver's whole
  process tree (the launcher, the Spark JVM, its Python workers), from ``/proc``;
- ``batches``: per query, the last micro-batch its checkpoint committed (``commits/``) + 1;
- ``batch_sum_s`` / ``batch_count``: Spark's ``triggerExecution`` of every batch that ran,
  summed over steps (the runner's ``isbflow_step_batch_duration_seconds`` histogram);
- ``heartbeat_age_s``: the oldest step heartbeat (status bucket) at the sample;
- ``files``: files under each checkpoint part (offsets, commits, state, other), each sink's
  data and ``_delta_log`` (both in ``files_total``), the writers' stats, the logs and the nats store;
- ``ledger_bytes``: bytes of every ledger KV value; ``rss_bytes`` / ``pss_bytes`` of the tree;
- ``lag``: messages the source step is behind, ``logs_bytes``: the driver logs' size
  (informational, in ``info_slopes`` with each kind of file).

The JSON's ``slopes``: per metric, the mean over the first fifth and the last fifth of the
measured run (from ``--settle-minutes`` after the first sample at which every step has committed a
batch, when the Delta logs have reached their retention and the state stores their retained
versions, to the end of producing), their ratio ``last / first`` and ``flat`` (ratio <= 1.1). Per-batch CPU and
commit latency are ratios of the counters' growth over each fifth (a fifth in which no batch
committed, as in a short run on a loaded machine, is widened towards the middle until one has;
``seconds`` gives each window's span). At the end the producer
stops, the pipeline is drained and the raw sink is checked exact: every produced event but
the dead letters, no ``_isb_id`` twice. Targets are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import _common as cm  # noqa: E402
from _common import log  # noqa: E402

SPEC = ROOT / "pipelines" / "logs.yaml"
FLAT = 1.1
#: seconds the pipeline may take to commit a first batch in every step (Spark's start on a loaded machine)
STARTUP_S = 900.0
#: times the driver is launched again when it exits before every step has committed a batch
STARTUP_RELAUNCHES = 3
#: the slopes compare the first and the last of this many equal parts of the steady run
PARTS = 5
#: metric -> label (a part is summarised by the mean of its samples, or for RATIOS the counters' ratio)
METRICS = {
    "cpu_per_batch_s": "CPU seconds of the driver tree per micro-batch (all queries)",
    "commit_latency_s": "mean micro-batch duration (Spark triggerExecution)",
    "heartbeat_age_s": "oldest step heartbeat age",
    "files_total": "files in the data dir (checkpoints, sinks, stats, logs, nats store)",
    "ledger_bytes": "bytes of the offset ledger's KV values",
    "delta_log_bytes": "bytes of every sink's _delta_log (commits and checkpoints)",
    "checkpoint_bytes": "bytes of the queries' Spark checkpoints (offsets, commits, state, metadata)",
    "state_bytes": "bytes of the queries' state stores (the checkpoints' state folders)",
    "rss_bytes": "RSS of the driver tree",
    "pss_bytes": "PSS of the driver tree",
}
RATIOS = {"cpu_per_batch_s": ("cpu_s", "batches_total"), "commit_latency_s": ("batch_sum_s", "batch_count")}


# ------------------------------------------------------------------ what one sample reads


def count_files(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path)) if path.exists() else 0


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (files removed while it is walked are left out)."""
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(folder, f)).st_size
            except FileNotFoundError:
                pass
    return total


def sizes(work: Path, pipeline: str, sinks: dict[str, Path]) -> dict[str, int]:
    """Bytes of the sinks' Delta logs, the queries' checkpoints and their state stores."""
    from isbflow.spec.paths import DataDir

    cps = DataDir(work).checkpoints(pipeline)
    queries = [q for q in (cps.iterdir() if cps.exists() else []) if q.is_dir()]
    return {"delta_log_bytes": sum(dir_bytes(t / "_delta_log") for t in sinks.values()),
            "checkpoint_bytes": sum(dir_bytes(q) for q in queries),
            "state_bytes": sum(dir_bytes(q / "state") for q in queries)}


def file_counts(work: Path, pipeline: str, sinks: dict[str, Path]) -> dict[str, int]:
    from isbflow.spec.paths import DataDir

    dd = DataDir(work)
    out = {"checkpoint_offsets": 0, "checkpoint_commits": 0, "checkpoint_state": 0, "checkpoint_other": 0}
    cps = dd.checkpoints(pipeline)
    for query in (cps.iterdir() if cps.exists() else []):
        for part in (query.iterdir() if query.is_dir() else []):
            key = f"checkpoint_{part.name}" if f"checkpoint_{part.name}" in out else "checkpoint_other"
            out[key] += count_files(part) if part.is_dir() else 1
    for name, table in sinks.items():
        log_files = count_files(table / "_delta_log")
        out[f"sink_{name}_data"] = count_files(table) - log_files
        out[f"sink_{name}_log"] = log_files
    out.update(stats=count_files(dd.stats_of(pipeline)), logs=count_files(dd.logs), nats=count_files(dd.nats))
    out["total"] = sum(out.values())
    return out


def batches_per_query(work: Path, pipeline: str) -> dict[str, int]:
    """Per query, its last committed batch id + 1 (Spark keeps only the newest commit files)."""
    from isbflow.spec.paths import DataDir

    out = {}
    cps = DataDir(work).checkpoints(pipeline)
    for query in sorted(cps.iterdir() if cps.exists() else []):
        ids = [int(f.name) for f in (query / "commits").glob("*") if f.name.isdigit()]
        if query.is_dir() and not query.name.startswith("_"):
            out[query.name] = max(ids) + 1 if ids else 0
    return out


def batches_per_step(queries: dict[str, int], steps: list[str]) -> dict[str, int]:
    """A step's batches: the fewest of its queries (a step with several out edges runs one each)."""
    from isbflow.spec.paths import query_name

    out = {}
    for v in steps:
        mine = [n for q, n in queries.items() if q == query_name(v, None) or q.startswith(query_name(v, ""))]
        out[v] = min(mine) if mine else 0
    return out


def scrape(url: str) -> tuple[float, int]:
    """(sum of batch seconds, batch count) over steps from the runner's /metrics."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total, count = 0.0, 0
    for line in text.splitlines():
        m = re.match(r"isbflow_step_batch_duration_seconds_(sum|count)\{[^}]*\} (\S+)", line)
        if m:
            if m.group(1) == "sum":
                total += float(m.group(2))
            else:
                count += int(float(m.group(2)))
    return total, count


def cpu_seconds(pids: list[int]) -> dict[int, tuple[float, float]]:
    """Per process of ``pids`` still there: (its own utime + stime, cutime + cstime of the children
    it has reaped), in seconds, from ``/proc/<pid>/stat``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        f = [int(x) for x in stat[stat.rfind(")") + 2:].split()[11:15]]
        out[pid] = ((f[0] + f[1]) / tick, (f[2] + f[3]) / tick)
    return out


def tree_cpu_seconds(pids: list[int]) -> float:
    """utime + stime + cutime + cstime of ``pids`` (a reaped child's time is in its parent's cutime)."""
    return sum(own + reaped for own, reaped in cpu_seconds(pids).values())


async def nats_sample(nc, pipeline: str, steps: list[str]) -> dict:
    from nats.js.errors import NoKeysError

    from isbflow.isb import naming
    from isbflow.isb.state import all_status

    statuses = await all_status(nc, pipeline, steps)
    now = time.time()
    ages = [now - s.updated_at for s in statuses.values() if s is not None]
    kv = await nc.jetstream().key_value(naming.ledger_bucket(pipeline))
    try:
        keys = await kv.keys()
    except NoKeysError:
        keys = []
    ledger = 0
    for k in keys:
        entry = await kv.get(k)
        ledger += len(entry.value or b"")
    src = statuses.get(steps[0])
    return {"heartbeat_age_s": round(max(ages), 3) if ages else None, "ledger_bytes": ledger,
            "ledger_keys": len(keys), "lag": sum((src.lag or {}).values()) if src else None,
            "states": {v: (s.state if s else "unknown") for v, s in statuses.items()}}


# ------------------------------------------------------------------ figures


def ends(series: list[dict], key: str, t0: float, t1: float, parts: int = PARTS) -> dict:
    """``key`` over the first and the last of ``parts`` equal parts of ``[t0, t1]``: the mean of its
    samples, or for a :data:`RATIOS` metric the growth of its numerator counter over its
    denominator's; their ratio."""
    span = (t1 - t0) / parts

    def summary(part: list[dict]) -> float | None:
        if key in RATIOS:
            num, den = RATIOS[key]
            d = part[-1][den] - part[0][den] if len(part) >= 2 else 0
            return (part[-1][num] - part[0][num]) / d if d > 0 else None
        vals = [s[key] for s in part if s.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    inside = [s for s in series if t0 <= s["t"] <= t1]
    first = [s for s in inside if s["t"] <= t0 + span]
    last = [s for s in inside if s["t"] >= t1 - span]
    if key in RATIOS:  # a part in which no batch committed (a short run on a loaded machine) has no
        # ratio: widen it, up to the middle of the run, until its denominator grew
        half = len(inside) // 2
        first = _widen(first, inside[:half], RATIOS[key][1])
        last = _widen(last[::-1], inside[half:][::-1], RATIOS[key][1])[::-1]
    a, b = summary(first), summary(last)
    ratio = None if a is None or b is None else (b / a if a else (1.0 if b == 0 else None))
    spans = [round(part[-1]["t"] - part[0]["t"], 2) if part else 0 for part in (first, last)]
    return {"first": _round(a), "last": _round(b), "ratio": _round(ratio), "samples": [len(first), len(last)],
            "seconds": spans}


def _widen(part: list[dict], bound: list[dict], den: str) -> list[dict]:
    """``part`` (a prefix of ``bound``, in the order to grow it) extended along ``bound`` until
    the counter ``den`` moved between its ends; ``part`` itself when it already has."""
    n = len(part)
    while n < len(bound) and (n < 2 or bound[n - 1][den] == bound[0][den]):
        n += 1
    return bound[:n] if n > len(part) else part


def slopes(series: list[dict], t0: float, t1: float) -> dict:
    """Every metric of :data:`METRICS` with its first and last part, ratio and ``flat`` (ratio <=
    :data:`FLAT`)."""
    out = {}
    for key, label in METRICS.items():
        m = ends(series, key, t0, t1)
        grew_from_zero = m["first"] == 0 and (m["last"] or 0) > 0  # no ratio: not flat
        out[key] = {"label": label, **m,
                    "flat": False if grew_from_zero else None if m["ratio"] is None else m["ratio"] <= FLAT}
    return out


def _round(x):
    return None if x is None else round(x, 6)


def downsample(series: list[dict], most: int = 400) -> list[dict]:
    step = max(1, -(-len(series) // most))
    return series[::step] + ([series[-1]] if (len(series) - 1) % step else [])


# ------------------------------------------------------------------ the run


class Producer:
    """Produces ``rate`` events/s in chunks of ``chunk_s`` seconds until stopped."""

    def __init__(self, settings, p, rate: float, malformed_every: int | None, chunk_s: float = 10.0):
        self.settings, self.p, self.rate, self.malformed_every = settings, p, rate, malformed_every
        self.chunk = max(1, int(rate * chunk_s))
        self.published = self.sent = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer", daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def _run(self) -> None:
        import asyncio

        from isbflow.ops.produce import produce

        try:
            while not self._stop.is_set():
                rep = asyncio.run(produce(self.settings, self.p, count=self.chunk, rate=self.rate, seed=cm.SEED,
                                          start=self.sent, malformed_every=self.malformed_every))
                self.sent += self.chunk
                self.published += rep.published
        except BaseException as e:  # noqa: BLE001 - reported by the run
            self.error = e

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def run(args, result: dict) -> None:
    """The soak (module docstring), filling ``result`` as it goes: a failed run still has its samples."""
    from isbflow.isb.connect import SyncSession, resolve_settings
    from isbflow.isb.server import start_embedded, stop_embedded
    from isbflow.ops import pipeline as ops
    from isbflow.ops.produce import is_malformed
    from isbflow.ops.sinks import maintain_sinks, sink_table_path
    from isbflow.sinks.maintain import MaintenanceError
    from isbflow.spec import load_specs
    from isbflow.spec.paths import DataDir
    from isbflow.steps.metrics import read_targets

    result.update({"machine": cm.machine(), "load_average_start": list(os.getloadavg()),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   "config": {k: getattr(args, k) for k in ("batches", "max_minutes", "wall_minutes", "rate", "trigger",
                                                            "malformed_every", "sample_every", "maintain_every",
                                                            "vacuum_hours", "log_retention_hours", "settle_minutes",
                                                            "quick")}
                   | {"spec": str(SPEC.relative_to(ROOT)), "master": "local[2]", "flat_when": f"last/first <= {FLAT}"}})
    work = Path(tempfile.mkdtemp(prefix="isbflow-bench-soak-"))
    specs = load_specs(SPEC)
    p = specs.only_pipeline()
    steps = p.topological_order()
    sinks = {v.name: Path(sink_table_path(p, v.name, work)) for v in p.spec.vertices if v.sink is not None}
    nats_started, record, producer, nats = False, None, None, None
    series: list[dict] = []
    maintenance: list[dict] = []
    try:
        start_embedded(work)
        nats_started = True
        settings = resolve_settings(data_dir=work)
        def launch(provision: bool = True):
            return ops.start(SPEC, specs, p, settings, work, workdir=ROOT, provision=provision,
                             references_dir=SPEC.parent / ops.REFERENCE_DIR, env={"ISBFLOW_METRICS_PORT": "-1"},
                             processing_time=args.trigger, progress=log).launch

        record = launch()
        relaunches: list[str] = []
        log(f"driver pid {record.pid}, log {record.log}; producing")
        nats = SyncSession(settings, name="isbflow-bench-soak")
        producer = Producer(settings, p, args.rate, args.malformed_every).start()
        t0 = time.time()
        wall_end = t0 + (args.wall_minutes * 60 if args.wall_minutes else float("inf"))
        deadline = min(t0 + STARTUP_S, wall_end)  # until every step has committed a batch; then the run's length
        steady_at = None
        last_maint = t0
        url = None
        while True:
            time.sleep(args.sample_every)
            now = time.time()
            if url is None:
                targets = read_targets(work, p.name) or []
                url = f"http://{targets[0]['targets'][0]}/metrics" if targets else None
            tree = cm.descendants(record.pid)
            mem = cm.tree_memory(tree)
            queries = batches_per_query(work, p.name)
            per_step = batches_per_step(queries, steps)
            try:
                bsum, bcount = scrape(url) if url else (0.0, 0)
            except OSError:  # the driver is gone (judged below) or not serving yet
                bsum, bcount, url = 0.0, 0, None
            s = {"t": round(now - t0, 2), "cpu_s": round(tree_cpu_seconds(tree), 2),
                 "batches_total": sum(queries.values()), "batches": per_step,
                 "batch_sum_s": round(bsum, 3), "batch_count": bcount,
                 "rss_bytes": mem["rss_bytes"], "pss_bytes": mem["pss_bytes"], "processes": len(tree),
                 "produced": producer.published, **nats.run(nats_sample(nats.nc, p.name, steps))}
            s["logs_bytes"] = sum(f.stat().st_size for f in DataDir(work).logs.glob("*") if f.is_file())
            s["files"] = file_counts(work, p.name, sinks)
            s["files_total"] = s["files"]["total"]
            s.update(sizes(work, p.name, sinks))
            series.append(s)
            if steady_at is None and all(n > 0 for n in per_step.values()):
                steady_at, deadline = s["t"], min(now + args.max_minutes * 60, wall_end)
                log(f"every step has committed a batch after {steady_at:.0f}s: the measured run starts")
            log(f"t={s['t']:.0f}s batches/step min {min(per_step.values())} ({per_step}), cpu {s['cpu_s']}s, "
                f"hb {s['heartbeat_age_s']}s, files {s['files_total']}, ledger {s['ledger_bytes']} B, "
                f"rss {s['rss_bytes'] >> 20} MiB, lag {s['lag']}, produced {s['produced']}")
            if record.alive() is False:
                if steady_at is not None or len(relaunches) >= STARTUP_RELAUNCHES:
                    raise RuntimeError(f"the driver exited; its log {record.log}:\n{record.log_tail()}")
                # before the measured run only: a query that exhausted its restarts while the
                # machine was too loaded to start its Python workers in time; start it again
                relaunches.append(record.log_tail(3))
                log(f"the driver exited before every step committed a batch; launching it again: {relaunches[-1]}")
                record, url = launch(provision=False), None
                continue
            if producer.error is not None:
                raise RuntimeError(f"the producer failed: {producer.error!r}")
            if args.maintain_every and now - last_maint >= args.maintain_every:
                last_maint = now
                try:
                    done = maintain_sinks(p, work, retention_hours=args.vacuum_hours, force=True,
                                          log_retention_hours=args.log_retention_hours)
                except MaintenanceError as e:  # as a scheduled maintenance run would: it fails, the next one runs
                    maintenance.append({"t": round(time.time() - t0, 2), "seconds": round(time.time() - now, 2),
                                        "failed": str(e)})
                    log(f"sink maintenance failed (the next run tries again): {e}")
                    continue
                maintenance.append({"t": round(time.time() - t0, 2), "seconds": round(time.time() - now, 2),
                                    **{k: v.to_json() for k, v in done.items()}})
                log("maintained the sinks (data files, log files): "
                    f"{[(k, v.files_before, v.files_after, v.log_files_before, v.log_files_after) for k, v in done.items()]}")
            if steady_at is None and now >= deadline:
                raise RuntimeError(f"some step committed no batch in {STARTUP_S:.0f}s: {per_step}; see {record.log}")
            if min(per_step.values()) >= args.batches or now >= deadline:
                break
        t_end = series[-1]["t"]
        producer.stop()
        if producer.error is not None:
            raise RuntimeError(f"the producer failed: {producer.error!r}")
        final = series[-1]["batches"]
        first = next(x["batches"] for x in series if x["t"] >= steady_at)
        result["run"] = {"seconds": t_end, "steady_from_s": steady_at, "steady_seconds": round(t_end - steady_at, 2),
                         "batches_per_step": final,
                         "steady_batches_per_step_per_s": {v: round((n - first[v]) / (t_end - steady_at), 3)
                                                           for v, n in final.items()},
                         "reached_target": min(final.values()) >= args.batches, "produced": producer.published,
                         "startup_relaunches": relaunches}
        measured_from = min(steady_at + args.settle_minutes * 60, (steady_at + t_end) / 2)
        result["run"]["measured_from_s"] = round(measured_from, 2)
        result["slopes"] = slopes(series, measured_from, t_end)
        result["all_flat"] = all(m["flat"] for m in result["slopes"].values())
        for kind in series[-1]["files"]:  # each kind of file on its own (files_total sums them)
            for x in series:
                x[f"files_{kind}"] = x["files"].get(kind, 0)
        result["info_slopes"] = {key: ends(series, key, measured_from, t_end)
                                 for key in ["lag", "logs_bytes", *(f"files_{k}" for k in series[-1]["files"])]}
        result["files_final"] = series[-1]["files"]
        result["delta_log_files_peak"] = {k: max(x["files"].get(f"sink_{k}_log", 0) for x in series) for k in sinks}
        log(f"produced {producer.published} events; draining")
        drained = ops.drain_and_wait(settings, p, work, timeout=900, exit_timeout=180)
        result["run"]["driver_exited"] = drained.driver_exited
        dead = sorted(nats.run(dead_origins(nats.nc, p.name)))
        malformed = sum(1 for i in range(producer.sent) if is_malformed(i, args.malformed_every))
        expected = {f"in/0/{k}" for k in range(1, producer.published + 1)} - set(dead)
        check_ = cm.raw_sink_check(str(sinks["raw"]), expected)
        result["sink"] = {**check_, "dead_letters": len(dead), "malformed_produced": malformed,
                          "exact": check_["exact"] and len(dead) == malformed}
    finally:
        result["maintenance"] = maintenance
        result["series"] = downsample(series)
        from isbflow.steps.launch import stop_launch

        # each clean-up runs whatever the one before it raised: the driver and nats-server are stopped by PID
        cm.undo_all((("producer", producer and producer.stop), ("nats session", nats and nats.close),
                     ("driver", record and (lambda: stop_launch(work, record.key, grace=20))),
                     ("nats-server", nats_started and (lambda: stop_embedded(work)))))
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        result["load_average_end"] = list(os.getloadavg())
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")


async def dead_origins(nc, pipeline: str) -> list[str]:
    from isbflow.isb.dlq import dead_letter_origins

    return await dead_letter_origins(nc, pipeline)


def print_table(r: dict) -> None:
    run_ = r["run"]
    print(f"\nran {run_['seconds']:.0f} s, batches per step {run_['batches_per_step']} "
          f"(target {r['config']['batches']}: {'reached' if run_['reached_target'] else 'NOT reached'})")
    print(f"{'metric':<70} {'first':>12} {'last':>12} {'ratio':>7}  flat")
    for m in r["slopes"].values():
        def f(x):
            return "n/a" if x is None else f"{x:.4g}"
        verdict = "n/a" if m["flat"] is None else ("yes" if m["flat"] else "NO")
        print(f"{m['label'][:70]:<70} {f(m['first']):>12} {f(m['last']):>12} {f(m['ratio']):>7}  {verdict}")
    s = r["sink"]
    print(f"raw sink: {s['rows']} rows, expected {s['expected']}, duplicates {s['duplicates']}, missing "
          f"{s['missing']}, unexpected {s['unexpected']}, dead letters {s['dead_letters']} "
          f"(malformed {s['malformed_produced']}): {'exact' if s['exact'] else 'NOT exact'}")


def main() -> None:
    cm.stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="about a minute: checks the harness, not the engine")
    ap.add_argument("--batches", type=int, help="stop producing once every step has this many (default 20,000)")
    ap.add_argument("--max-minutes", type=float, help="stop producing after this long at most (default 60)")
    ap.add_argument("--wall-minutes", type=float, help="stop producing this long after the start at the latest, "
                                                       "Spark's start-up included (default: no limit)")
    ap.add_argument("--rate", type=float, default=100.0, help="events per second (default 100)")
    ap.add_argument("--trigger", help="the queries' trigger interval (default 200 milliseconds; quick 3 seconds: "
                                      "at 200 ms the seven queries saturate two cores, which the suite shares)")
    ap.add_argument("--malformed-every", type=int, default=500, help="every K-th event is malformed")
    ap.add_argument("--sample-every", type=float, help="seconds between samples (default 10; quick 2)")
    ap.add_argument("--maintain-every", type=float, help="seconds between sink maintenance runs (default 300; "
                                                         "quick 20; 0: never)")
    ap.add_argument("--vacuum-hours", type=int, default=0, help="vacuum retention (default 0: accelerated)")
    ap.add_argument("--log-retention-hours", type=float,
                    help="Delta log retention of the maintenance (default: twice --maintain-every; quick 0)")
    ap.add_argument("--settle-minutes", type=float,
                    help="the slopes' window starts this long after every step's first batch, once the log "
                         "retention and a maintenance run have passed (default: log retention + maintenance "
                         "interval; quick 0; at most half the run)")
    ap.add_argument("--out", default=str(BENCH / "results" / "soak.json"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary data dir")
    args = ap.parse_args()
    if args.batches is None:
        args.batches = 10**9 if args.quick else 20_000
    if args.max_minutes is None:
        args.max_minutes = 0.75 if args.quick else 60.0
    if args.sample_every is None:
        args.sample_every = 2.0 if args.quick else 10.0
    if args.trigger is None:
        args.trigger = "3 seconds" if args.quick else "200 milliseconds"
    if args.maintain_every is None:
        args.maintain_every = 20.0 if args.quick else 300.0
    if args.log_retention_hours is None:
        args.log_retention_hours = 0.0 if args.quick else 2 * args.maintain_every / 3600
    if args.settle_minutes is None:
        args.settle_minutes = 0.0 if args.quick else (args.log_retention_hours * 3600 + args.maintain_every) / 60
    result: dict = {}
    try:
        run(args, result)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        cm.write_result(result, args.out, lambda r: None)  # the samples so far, for the post-mortem
        raise
    cm.write_result(result, args.out, print_table)


if __name__ == "__main__":
    main()
