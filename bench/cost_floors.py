"""The floors of ``bench/cost.py`` (run in its child process): as many queries as the demo has, each
reading the rate with the demo's trigger: from Spark's built-in ``rate`` source into ``noop``
(``rate``), from :class:`CounterSource`, a trivial Python streaming data source (one partition, rows
from a counter), into ``noop`` (``python``), and from :class:`CounterSource` into :class:`NullSink`, a
trivial Python streaming sink (each task drains its rows, the driver's commit does nothing:
``python_io``). Every query of the demo reads through a Python data source and writes through a
Python sink (``format("jetstream")``) or a ``foreachBatch`` function, so ``python_io`` is the least a
query of isbflow's shape can cost. Spark's Python workers import this module (``PYTHONPATH`` holds
``bench/``)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import _common as cm
from _common import log
from cost_profile import cpu_snapshot, cpu_split
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from soak import tree_cpu_seconds


class CounterReader(DataSourceStreamReader):
    """One partition; offset = rows the rate has produced since the reader was made."""

    def __init__(self, rate: float):
        self.rate, self.t0 = rate, time.time()

    def initialOffset(self) -> dict:
        return {"n": 0}

    def latestOffset(self) -> dict:
        return {"n": int((time.time() - self.t0) * self.rate)}

    def partitions(self, start: dict, end: dict) -> list:
        return [InputPartition((start["n"], end["n"]))]

    def read(self, partition):
        lo, hi = partition.value
        for i in range(lo, hi):
            yield (i,)

    def commit(self, end: dict) -> None:
        pass


class CounterSource(DataSource):
    """``format("isb-bench-counter")``, option ``rate``: the trivial Python streaming source floor."""

    @classmethod
    def name(cls) -> str:
        return "isb-bench-counter"

    def schema(self) -> str:
        return "value BIGINT"

    def streamReader(self, schema) -> CounterReader:
        return CounterReader(float(self.options.get("rate", 100)))


class NullWriter(DataSourceStreamArrowWriter):
    """Each task drains its Arrow batches (as isbflow's ``format("jetstream")`` writer takes its rows)
    and hands the driver an empty message; the commit does nothing."""

    def write(self, iterator) -> WriterCommitMessage:
        for _ in iterator:
            pass
        return WriterCommitMessage()

    def commit(self, messages, batchId) -> None:  # noqa: N803 (Spark's name)
        pass

    def abort(self, messages, batchId) -> None:  # noqa: N803
        pass


class NullSink(DataSource):
    """``format("isb-bench-null")``: the trivial Python streaming sink of the ``python_io`` floor."""

    @classmethod
    def name(cls) -> str:
        return "isb-bench-null"

    def streamWriter(self, schema, overwrite: bool) -> NullWriter:  # noqa: N802
        return NullWriter()


#: the floors every run measures; ``python_io`` (CounterSource -> NullSink) when asked (``--floors``)
KINDS = ("rate", "python")
#: each floor kind: (source format, sink format)
FORMATS = {"rate": ("rate", "noop"), "python": ("isb-bench-counter", "noop"),
           "python_io": ("isb-bench-counter", "isb-bench-null")}


def floors_child(cfg: dict) -> dict:
    """In the child: every floor kind at every rate; its own tree's figures per window."""
    from cost import Sampler, window_figures

    from isbflow.steps.session import spark_session

    spark = spark_session(app_name="isbflow-bench-cost-floor")
    spark.dataSource.register(CounterSource)
    spark.dataSource.register(NullSink)
    checkpoints = tempfile.mkdtemp(prefix="isbflow-bench-floors-")
    out: dict = {}
    for n, rate in enumerate(cfg["rates"]):
        for kind in cfg.get("kinds", KINDS):
            log(f"floor {kind} at {rate:g}/s: {cfg['queries']} queries")
            def start(i: int, kind=kind, rate=rate):
                source, sink = FORMATS[kind]
                src = (spark.readStream.format("rate").option("rowsPerSecond", str(int(rate)))
                       .option("numPartitions", "1") if source == "rate"
                       else spark.readStream.format(source).option("rate", str(rate))).load()
                w = src.writeStream.format(sink).queryName(f"floor_{kind}_{i}")
                if sink != "noop":  # Spark gives noop a temporary checkpoint; a data source sink names one
                    w = w.option("checkpointLocation", os.path.join(checkpoints, f"{kind}-{i}-{time.time_ns()}"))
                return w.trigger(processingTime=cfg["trigger"]).start()

            # one after another, each once it ran its first batch: seven Python-source queries started at
            # once failed their first tasks, "java.io.OptionalDataException" deserializing a HashMap (a
            # map serialized while another thread changed it), again on every restart
            qs, restarts = [], 0
            for i in range(cfg["queries"]):
                qs.append(start(i))
                first = time.time() + 120
                while time.time() < first and qs[i].lastProgress is None:
                    if not qs[i].isActive and restarts < 20:
                        restarts += 1
                        qs[i] = start(i)
                    time.sleep(0.5)
            deadline = time.time() + 900  # every query's first batch (its Python workers started on a loaded machine)
            while time.time() < deadline and not all((q.lastProgress or {}).get("batchId", -1) >= 1 for q in qs):
                for i, q in enumerate(qs):
                    if not q.isActive and restarts < 20:  # failed: "Python worker failed to connect back" (load)
                        restarts += 1
                        qs[i] = start(i)
                time.sleep(1)
            time.sleep(cfg["warmup"] + (cfg.get("settle", 0.0) if n == 0 else 0.0))
            sampler = Sampler(os.getpid(), cfg["sample_every"])
            # the sampler runs in this process, the root of the tree measured: its CPU (reading every
            # process's smaps_rollup every 2 s: 13.2 and 18.5 ms a batch of the `rate` and Python floors
            # as measured) is not the floor's and is taken out below; the demo's sampler runs outside the driver's
            # tree. A sample just before t0 or after t1 is taken out too (one ~20 ms read in a 120 s window)
            tree = cm.descendants(os.getpid())
            split0 = cpu_snapshot(tree, os.getpid())
            t0, cpu0 = time.time(), tree_cpu_seconds(tree)
            ids0 = [(q.lastProgress or {}).get("batchId", -1) for q in qs]
            time.sleep(cfg["window"])
            tree = cm.descendants(os.getpid())
            t1, cpu1 = time.time(), tree_cpu_seconds(tree)
            split1 = cpu_snapshot(tree, os.getpid())
            ids1 = [(q.lastProgress or {}).get("batchId", -1) for q in qs]
            mem = sampler.stop()
            phases: dict[str, int] = {}
            rows = 0
            for q in qs:
                for prog in q.recentProgress:
                    if prog["batchId"] > ids0[qs.index(q)] and prog["batchId"] <= ids1[qs.index(q)]:
                        rows += prog["numInputRows"]
                        for k, v in prog["durationMs"].items():
                            phases[k] = phases.get(k, 0) + v
                q.stop()
            batches = sum(b - a for a, b in zip(ids0, ids1, strict=True))
            sink = ((qs[0].lastProgress or {}).get("sink") or {}).get("description")  # what the floor wrote into
            w = window_figures(cpu1 - cpu0 - mem["sampler_cpu_s"], t1 - t0, int(rate * (t1 - t0)), batches)
            split = cpu_split(split0, split1, batches, less={"driver python": mem["sampler_cpu_s"]})
            w.update(mem, restarts=restarts, sink=sink, rows_per_query_per_s=round(rows / cfg["queries"] / (t1 - t0), 1),
                     batches_per_query_per_s=round(min(b - a for a, b in zip(ids0, ids1, strict=True)) / (t1 - t0), 3),
                     duration_ms_per_batch={k: round(v / batches, 1) for k, v in phases.items()} if batches else {},
                     where_cpu_goes=split)
            out.setdefault(str(rate), {})[kind] = w
            log(f"floor {kind} {rate:g}/s: {w['cores']} cores, {w['cpu_ms_per_batch']} ms/batch")
    out["child_cpu_s"] = tree_cpu_seconds(cm.descendants(os.getpid()))
    spark.stop()
    shutil.rmtree(checkpoints, ignore_errors=True)
    return out
