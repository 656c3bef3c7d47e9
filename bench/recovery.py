"""Recovery benchmark (issue #5 item 6): a buffer lost half-way through a continuous run.

    python bench/recovery.py [--quick] [--count N] [--out bench/results/recovery.json] [--keep]

Starts its own embedded nats-server (file storage, temporary data dir, stopped by PID at the
end) and one SparkSession ``local[2]``, then:

1. publishes ``--count`` demo events (acked; not timed as part of any figure) to the source of
   ``in -> parse (2 partitions) -> raw (Delta)`` (the demo's parse transform);
2. **normal**: runs the pipeline continuously and samples the raw sink's row count;
3. **loss**: when the sink holds half of the events, deletes the edge stream ``parse -> raw``
   partition 0 (records in it not yet committed are gone);
4. **detect + recover**: the raw step stops on ``BufferLost``; :func:`isbflow.recovery.recover`
   (what ``isbflow replay --mode recover`` runs) drains, recreates the lost region, rewinds the
   source to the offset ledger's low offset and replays it; the run ends when recover returns
   with every sink check passed (count equals the source range, no duplicate ``_isb_id``).

Figures (JSON top level):

- ``replay_over_normal`` (target >= 0.8), like for like: the replay's steady rate (rows the
  raw sink gained from the replay's first commit until it held every event, per second) over
  the normal steady rate (rows the sink committed per second from its first commit to the
  loss); start-ups excluded on both sides. ``ratios_other_basis`` has the replay phase's
  rate with its start-ups (``replay_phase_over_normal_steady``) and the whole-run bases;
- ``recovery_overhead`` (target <= 2): seconds from the loss to complete sinks, over the
  seconds the normal run would have taken for what the sink still lacked at the loss
  (``(count - rows at loss) / normal records/s``);
- raw figures: rows at the loss, low offset, records replayed, per-phase seconds, the
  normal rate on the other basis (whole: from the pipeline's start), load averages.

Targets are reported, never asserted: the machine is shared, so ratios from one run hold and
absolute seconds do not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]
# Spark's Python workers import the demo transforms (spark_apps/): hand them the path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(BENCH), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import _common as cm  # noqa: E402

TARGETS = [  # key, label, comparison, bound
    ("replay_over_normal", "replay / normal records/s", ">=", 0.8),
    ("recovery_overhead", "loss -> complete sinks / normal time for the missing range", "<=", 2.0),
]


def spec(batch_rows: int) -> str:
    return f"""
{cm.ISB_SERVICE_YAML}apiVersion: isbflow.io/v1alpha1
kind: Pipeline
metadata:
  name: benchrec
spec:
  interStepBufferServiceName: default
  limits:
    readBatchSize: {batch_rows}
  vertices:
    - name: in
      source:
        jetstream:
          subject: benchrec.events
        schema: "{cm.SOURCE_DDL}"
    - name: parse
      partitions: 2
      udf:
        transform: spark_apps.logs:parse
    - name: raw
      sink:
        delta:
          path: sinks/raw
  edges:
    - from: in
      to: parse
      partitionKey: service
    - from: parse
      to: raw
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ratio(a, b):
    return round(a / b, 3) if a and b else None


class Sampler:
    """The raw sink's row count every ``interval`` s, in a thread: (seconds since ``t0``, rows)."""

    def __init__(self, table: Path, t0: float, interval: float = 0.2):
        self.table, self.t0, self.interval = table, t0, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sink-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rows = cm.sink_rows(str(self.table)) if (self.table / "_delta_log").exists() else 0
            self.samples.append((cm.now() - self.t0, rows))
            self._stop.wait(self.interval)

    def rows(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def run(count: int, keep: bool) -> dict:
    from isbflow.isb import naming, provision
    from isbflow.isb.connect import connect, resolve_settings
    from isbflow.isb.server import start_embedded, stop_embedded
    from isbflow.ops.produce import produce
    from isbflow.recovery.recover import recover
    from isbflow.spec import load_specs
    from isbflow.steps.runner import PipelineRunner, spark_session

    batch_rows = max(1000, count // 10)
    result: dict = {"machine": cm.machine(), "load_average_start": list(os.getloadavg()),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "config": {"count": count, "read_batch_rows": batch_rows, "pipeline": "in -> parse (2) -> raw",
                               "lost_buffer": "parse -> raw, partition 0", "processing_time": "1 second"}}
    work = Path(tempfile.mkdtemp(prefix="isbflow-bench-recovery-"))
    spark = None
    nats_started = False
    try:
        (work / "spec.yaml").write_text(spec(batch_rows))
        specs = load_specs(work / "spec.yaml")
        p = specs.only_pipeline()
        start_embedded(work, max_file_store=40 * 1024**3)
        nats_started = True
        settings = resolve_settings(data_dir=work)
        asyncio.run(provision.apply(settings, specs))
        spark = spark_session("local[2]", app_name="isbflow-bench-recovery")
        spark.sparkContext.setLogLevel("ERROR")

        log(f"publishing {count} events")
        rep = asyncio.run(produce(settings, p, count=count, seed=cm.SEED))
        result["produce"] = rep.to_json()
        assert rep.published == count, rep.to_json()

        # ---- normal
        raw = work / "sinks" / "raw"
        lost = naming.EdgePartition(p.name, "parse", "raw", 0).stream
        runner = PipelineRunner(spark, specs, p, settings, work, processing_time="1 second")
        outcome: dict = {}

        def go() -> None:
            try:
                outcome["out"] = runner.run_continuous(poll=0.3)
            except BaseException as e:  # noqa: BLE001 - the loss is expected to stop it
                outcome["error"] = e
            outcome["ended"] = cm.now()

        t0 = cm.now()
        sampler = Sampler(raw, t0)
        thread = threading.Thread(target=go, name="pipeline", daemon=True)
        thread.start()
        log("pipeline running; waiting for the sink to hold half of the events")
        deadline = time.monotonic() + max(600.0, count / 500)
        while sampler.rows() < count // 2:
            if not thread.is_alive():
                raise RuntimeError(f"the pipeline stopped before the loss: {outcome.get('error')!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sink holds {sampler.rows()} rows after {cm.now() - t0:.0f}s")
            time.sleep(0.05)

        # ---- loss
        async def delete() -> None:
            nc = await connect(settings)
            try:
                await nc.jetstream().delete_stream(lost)
            finally:
                await nc.close()

        rows_at_loss = cm.sink_rows(str(raw))
        asyncio.run(delete())
        t_loss = cm.now()
        log(f"deleted {lost} at {t_loss - t0:.1f}s with {rows_at_loss} rows in the sink")
        thread.join(300)
        runner.close()
        if "error" not in outcome:
            raise RuntimeError("the pipeline did not stop on the lost buffer")
        detected = outcome["ended"]
        log(f"the pipeline stopped {detected - t_loss:.1f}s after the loss: "
            f"{str(outcome['error']).splitlines()[0][:200]}")

        # ---- recover
        report = recover(spark, specs, p, settings, work)
        t_done = cm.now()
        sampler.stop()
        log(f"recovered {t_done - t_loss:.1f}s after the loss: {report.state}, ok={report.ok}")
        final_rows = cm.sink_rows(str(raw))

        # ---- figures
        committed = [(t, r) for t, r in sampler.samples if r > 0 and t <= t_loss - t0]
        first_t, first_rows = committed[0]
        steady_s = (t_loss - t0) - first_t
        normal = {
            "rows_at_loss": rows_at_loss,
            "seconds_to_loss": round(t_loss - t0, 3),
            "first_commit_s": round(first_t, 3),
            "records_per_s": ratio(rows_at_loss - first_rows, steady_s),
            "whole_records_per_s": ratio(rows_at_loss, t_loss - t0),
            "basis": "steady: rows the sink committed from its first commit to the loss, per second",
        }
        replay_phase = next(ph for ph in report.phases if ph.name == "replay")
        # the replay's steady rate, on the normal rate's basis: rows the sink gained from the
        # replay's first commit to its last, per second (its start-up excluded)
        after = [(t, r) for t, r in sampler.samples if t > t_loss - t0]
        grew = [(t, r) for t, r in after if r > rows_at_loss]
        full = next(((t, r) for t, r in after if r >= count), None)
        replay_steady = (ratio(full[1] - grew[0][1], full[0] - grew[0][0])
                         if grew and full and full[0] > grew[0][0] else None)
        missing = count - rows_at_loss
        normal_time_for_missing = missing / normal["records_per_s"] if normal["records_per_s"] else None
        raw_check = next(s for s in report.sinks if s.sink == "raw")
        result.update({
            "normal": normal,
            "loss": {"stream": lost, "at_s": round(t_loss - t0, 3), "rows_in_sink": rows_at_loss,
                     "missing_from_sink": missing},
            "detect_seconds": round(detected - t_loss, 3),
            "recover_seconds": round(t_done - detected, 3),
            "loss_to_complete_seconds": round(t_done - t_loss, 3),
            "normal_seconds_for_missing": round(normal_time_for_missing, 3) if normal_time_for_missing else None,
            "replay": {"records": report.replayed_records, "seconds": replay_phase.seconds,
                       "records_per_s": ratio(report.replayed_records, replay_phase.seconds),
                       "steady_records_per_s": replay_steady,
                       "first_commit_after_loss_s": round(grew[0][0] - (t_loss - t0), 3) if grew else None,
                       "low_offset": report.low_offsets.get("in/0", {}).get("low")},
            "phases": {ph.name: ph.seconds for ph in report.phases},
            "complete": bool(report.ok and final_rows == count and raw_check.duplicates == 0
                             and raw_check.missing == 0),
            "sink": {"rows": final_rows, "inserted_by_replay": raw_check.inserted,
                     "dropped_as_duplicates": raw_check.dropped, "duplicates": raw_check.duplicates,
                     "missing": raw_check.missing},
            "recovery_report": report.to_json(),
        })
        # like for like: steady over steady (start-ups excluded on both sides); the other bases below
        result["replay_over_normal"] = ratio(replay_steady, normal["records_per_s"])
        result["recovery_overhead"] = ratio(result["loss_to_complete_seconds"], normal_time_for_missing)
        result["ratios_other_basis"] = {
            "replay_phase_over_normal_steady": ratio(result["replay"]["records_per_s"], normal["records_per_s"]),
            "replay_over_normal_whole": ratio(result["replay"]["records_per_s"], normal["whole_records_per_s"]),
            "recovery_overhead_whole": ratio(result["loss_to_complete_seconds"],
                                             missing / normal["whole_records_per_s"]
                                             if normal["whole_records_per_s"] else None),
        }
    finally:
        if spark is not None:
            spark.stop()
        if nats_started:
            stop_embedded(work)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    result["load_average_end"] = list(os.getloadavg())
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result["targets"] = [{"key": k, "label": label, "value": result.get(k), "target": f"{op} {bound:g}",
                          "met": None if result.get(k) is None else
                          (result[k] >= bound if op == ">=" else result[k] <= bound)}
                         for k, label, op, bound in TARGETS]
    result["notes"] = [
        "Normal: the three steps run at once (continuous, 1 s trigger) in one Spark application; "
        "replay: recover runs the region's steps at once too (continuous, drained as soon as they "
        "started), each query starting anew; the sink merges on _isb_id, or appends a batch whose "
        "source offsets its commits never recorded (the ledger fast path).",
        "The loss deletes one of the two partition streams of parse -> raw; recover replays the whole "
        "region (in, parse, raw) from the ledger's low offset: the first source sequence not yet in "
        "the raw sink.",
        "The machine is shared (2 cores, other engineers' tests): compare ratios within one run; "
        "absolute seconds vary with the load averages recorded at start and end.",
    ]
    return result


def print_table(r: dict) -> None:
    print(f"\n{'target':<62} {'value':>10} {'goal':>8}  result")
    for t in r["targets"]:
        v = "n/a" if t["value"] is None else f"{t['value']:g}"
        res = "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")
        print(f"{t['label']:<62} {v:>10} {t['target']:>8}  {res}")
    n, rp = r["normal"], r["replay"]
    print(f"\nnormal: {n['records_per_s']} rec/s steady ({n['whole_records_per_s']} whole), "
          f"{n['rows_at_loss']} rows at the loss ({n['seconds_to_loss']} s)")
    print(f"replay: {rp['records']} records from sequence {rp['low_offset']} in {rp['seconds']} s = "
          f"{rp['records_per_s']} rec/s")
    print(f"loss -> complete: {r['loss_to_complete_seconds']} s (detect {r['detect_seconds']} s, recover "
          f"{r['recover_seconds']} s: {r['phases']}); normal time for the missing range "
          f"{r['normal_seconds_for_missing']} s; sinks complete: {r['complete']}")


def main() -> None:
    cm.stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20,000 events: checks the harness, not the engine")
    ap.add_argument("--count", type=int, help="events (default 1,000,000; quick 20,000)")
    ap.add_argument("--out", default=str(BENCH / "results" / "recovery.json"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary data dir")
    args = ap.parse_args()
    count = args.count or (20_000 if args.quick else 1_000_000)
    cm.write_result(run(count, args.keep), args.out, print_table)


if __name__ == "__main__":
    main()
