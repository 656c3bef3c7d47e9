"""What a buffer store costs: measurement A of bench/throughput.py on each store; see bench/README.md.

    python bench/stores.py [--quick] [--records N] [--rounds R] [--stores plain,chachapoly,aes,redis]
                           [--settle S] [--out bench/results/stores.json] [--keep]

One process, one SparkSession ``local[2]`` (as bench/throughput.py starts it), and one store per
kind, each in its own data dir, stopped by PID at the end:

- ``plain``: an embedded nats-server, file storage, JetStream not encrypted;
- ``chachapoly``: the same with ``jetstream.encryption: true, cipher: chachapoly`` in the spec;
- ``aes``: the same with ``cipher: aes``;
- ``redis``: an embedded redis-server, the append-only file on (``redis: {native: {persistence:
  true}}``), written and read through isbflow's Redis buffers (bench/stores_redis.py).

Each server is started as isbflow starts it for the spec (:func:`isbflow.isb.server.start_embedded`
with the spec's cipher, its key generated into the data dir) and provisioned with
``provision.apply(..., data_dir=...)``, which refuses a server whose cipher is not the spec's. The
Redis store is started and provisioned as ``isbflow isb up`` and ``isbflow isb apply`` do it.

Every round measures every store, in an order rotated each round (plain, chachapoly, aes; then
chachapoly, aes, plain; ...) so that each store takes each place and the machine's noise falls on
all alike. On a store, a round: the edge's two partition streams are deleted and created again
empty, the same records (:func:`_common.records`) are published into them as Arrow frames
(JetStream: ``throughput.publish_frames``, acked, 16 in flight; Redis: the same frames through
``RedisBuffer.write``, 64 frames a call, one call at a time), timed; after ``--settle`` seconds (12 by
default: nats-server keeps the blocks it has just written cached in memory for a few seconds,
``defaultCacheBufferExpiration`` in its filestore, so a read right after the publish would skip
part of the decryption) A reads them into a fresh Delta table written through as a Delta sink
vertex runs (``throughput.Bench``), timed: records/s whole and steady. Beside each phase, CPU
seconds from ``/proc``: the store's server, the publisher (this process's main thread) while
publishing, Spark's processes (the JVM, the zygote and the Python workers it forks) and this
process while reading. After publishing, the store's folders are checked: every stream of an encrypted store
has nats-server's ``meta.key`` and none of the plain store's does (Redis encrypts nothing: no check).

Before the rounds, unreported: a warm-up query from memory, then on each store one fill and one
batch of A's size written through (``Bench.warm_through``).

The JSON: ``rounds`` (every figure of every round), ``summary`` (per store, the median over the
rounds), ``ratios`` (per store but plain, its median over plain's: below 1 for a rate means
slower, above 1 for CPU means dearer) and ``ratios_per_round`` (each round's figure over plain's
in the same round). The keys say ``nats`` for the store's server on either store
(``publish_nats_cpu_s_per_m``: redis-server's CPU on Redis). Nothing is asserted; ratios of one
run hold, absolute seconds do not.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
sys.modules.setdefault("stores", sys.modules[__name__])  # bench/stores_redis.py imports this module, run or not

import _common as cm  # noqa: E402
import throughput as tp  # noqa: E402  (sets the paths and environment Spark's workers need)
from _common import log  # noqa: E402
from soak import tree_cpu_seconds  # noqa: E402

#: the stores a run can name, in the order they are measured in the first round
KINDS = ("plain", "chachapoly", "aes", "redis")
DEFAULT_KINDS = ("plain", "chachapoly", "aes")
#: the cipher of each JetStream store (``none``: not encrypted)
CIPHER = {"plain": "none", "chachapoly": "chachapoly", "aes": "aes"}
#: the trigger the session's JVM options are chosen for (as bench/throughput.py's F)
TRIGGER = "200 milliseconds"
#: figures compared between stores: (key in summary, label, kind: "rate" or "cost")
FIGURES = (
    ("publish_records_per_s", "publish records/s", "rate"),
    ("a_records_per_s", "A records/s, whole", "rate"),
    ("a_steady_records_per_s", "A records/s, steady", "rate"),
    ("publish_nats_cpu_s_per_m", "server CPU s per 1M records published", "cost"),
    ("read_nats_cpu_s_per_m", "server CPU s per 1M records read", "cost"),
    ("store_bytes_per_record", "store bytes per record", "cost"),
)


def spec_for(cipher: str) -> str:
    """bench/throughput.py's spec, its ISB service encrypted at rest with ``cipher`` (unless ``none``)."""
    if cipher == CIPHER["plain"]:
        return tp.SPEC
    anchor = "    url: embedded\n"
    service = cm.ISB_SERVICE_YAML.replace(anchor, f"{anchor}    encryption: true\n    cipher: {cipher}\n", 1)
    if service == cm.ISB_SERVICE_YAML or cm.ISB_SERVICE_YAML not in tp.SPEC:
        raise RuntimeError("bench/_common.ISB_SERVICE_YAML changed: spec_for no longer finds where to add "
                           "jetstream.encryption")
    return tp.SPEC.replace(cm.ISB_SERVICE_YAML, service)


def _cpu(pid: int) -> float:
    return tree_cpu_seconds([pid])


@functools.cache
def _server_exes() -> frozenset[str]:
    """The files the stores' servers run: nats-server, and redis-server as ``/proc/<pid>/exe`` shows it."""
    from stores_redis import server_exe

    return frozenset(filter(None, ("nats-server", "redis-server", server_exe())))


def _spark_tree() -> list[int]:
    """The Spark JVM's tree and the zygote's (which forks the Python workers): every process below
    this one but the stores' servers (nats-server, redis-server and its forks)."""
    me = os.getpid()
    out = []
    for pid in cm.descendants(me):
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if pid != me and exe not in _server_exes() and os.path.basename(exe) not in _server_exes():
            out.append(pid)
    return out


def _process_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _bytes_under(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:  # a file the server removed meanwhile
            pass
    return total


# ------------------------------------------------------------------ stores


class Store:
    """A buffer store measurement A runs on. :meth:`start` brings it up (with ``spark`` and the
    RSS ``sampler`` of the run), :meth:`refill` empties its buffers and publishes ``records`` rows
    into them (timed), :meth:`measure_a` reads them into a fresh Delta table, :meth:`stop` stops
    what :meth:`start` started (by PID). ``bench`` is the :class:`throughput.Bench` reading it."""

    kind: str
    bench: tp.Bench

    def start(self, spark, sampler) -> None:
        raise NotImplementedError

    def refill(self, records: int) -> dict:
        raise NotImplementedError

    def measure_a(self, name: str, records: int) -> dict:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class JetStreamStore(Store):
    """An embedded nats-server in its own data dir ``root / kind``, encrypted with ``cipher`` or not."""

    def __init__(self, kind: str, root: Path, cfg: tp.Config):
        self.kind, self.cipher, self.cfg = kind, CIPHER[kind], cfg
        self.dir = root / kind
        self.state = None

    def start(self, spark, sampler) -> None:
        from isbflow.isb import naming, provision
        from isbflow.isb.connect import resolve_settings
        from isbflow.isb.provision_server import wanted_cipher
        from isbflow.isb.server import start_embedded
        from isbflow.spec import load_specs

        self.dir.mkdir(parents=True)
        (self.dir / "spec.yaml").write_text(spec_for(self.cipher))
        self.specs = load_specs(self.dir / "spec.yaml")
        self.p = self.specs.only_pipeline()
        cipher = wanted_cipher(self.specs, self.p.name)
        if cipher != self.cipher:
            raise RuntimeError(f"store {self.kind}: the spec asks for cipher {cipher}, not {self.cipher}")
        self.state = start_embedded(self.dir, cipher=cipher)
        self.pid = self.state.nodes[0].pid
        self.settings = resolve_settings(data_dir=self.dir)
        asyncio.run(provision.apply(self.settings, self.specs, data_dir=self.dir))
        edge = [ep for ep in naming.edge_partitions(self.p) if ep.to_vertex == "raw"]
        self.streams, self.subjects = [ep.stream for ep in edge], [ep.subject for ep in edge]
        self.max_payload = self.specs.service_for(self.p).spec.jetstream.settings.max_payload
        self.bench = tp.Bench(self.cfg, self.dir, spark, self.settings, self.specs, sampler)
        log(f"{self.kind}: nats-server pid {self.pid}, cipher {cipher}, at {self.dir}")

    def _stores(self) -> list[Path]:
        from isbflow.isb.server import nats_dir

        return [nats_dir(self.dir) / n.name / "jetstream" for n in self.state.nodes]

    async def _drop_streams(self) -> None:
        from nats.js.errors import NotFoundError

        from isbflow.isb.connect import connect

        nc = await connect(self.settings, name="bench-stores")
        try:
            js = nc.jetstream()
            for s in self.streams:
                try:
                    await js.delete_stream(s)
                except NotFoundError:
                    pass
        finally:
            await nc.close()

    def refill(self, records: int) -> dict:
        """The edge's streams deleted and created again empty (not timed), then ``records`` rows
        published as frames (timed), with the server's and the publisher's CPU over the publish."""
        from isbflow.isb import encryption, provision

        asyncio.run(self._drop_streams())
        asyncio.run(provision.apply(self.settings, self.specs, data_dir=self.dir))
        n0, p0 = _cpu(self.pid), time.thread_time()
        out = asyncio.run(tp.publish_frames(self.settings, self.subjects, records, self.cfg.frame_rows,
                                            self.max_payload))
        out["nats_cpu_s"] = round(_cpu(self.pid) - n0, 3)
        out["publisher_cpu_s"] = round(time.thread_time() - p0, 3)
        out["nats_cores"] = round(out["nats_cpu_s"] / out["seconds"], 3)
        out["publisher_cores"] = round(out["publisher_cpu_s"] / out["seconds"], 3)
        stores = self._stores()
        out["store_bytes"] = sum(_bytes_under(s) for s in stores)
        enc, plain = encryption.stream_dirs(stores)
        mine = set(self.streams)
        out["streams_encrypted"] = sorted(d.name for d in enc if d.name in mine)
        out["streams_plain"] = sorted(d.name for d in plain if d.name in mine)
        want = out["streams_encrypted"] if self.cipher != encryption.PLAIN else out["streams_plain"]
        out["encryption_as_specified"] = sorted(want) == sorted(self.streams)
        return out

    def measure_a(self, name: str, records: int) -> dict:
        """A on this store (``Bench.run`` of ``frames_through``), with the CPU of the server, of
        Spark's processes (the JVM, the zygote and the Python workers it forks: :func:`_spark_tree`)
        and of this process (the driver's Python: the Delta commit, py4j, the RSS sampler) over the
        query. A worker that ended within the query counts once its parent has reaped it."""
        n0, s0, b0 = _cpu(self.pid), tree_cpu_seconds(_spark_tree()), _process_cpu()
        out = self.bench.run(self.bench.frames_through(), name, records, sink="through")
        out["nats_cpu_s"] = round(_cpu(self.pid) - n0, 3)
        out["spark_cpu_s"] = round(tree_cpu_seconds(_spark_tree()) - s0, 3)
        out["bench_cpu_s"] = round(_process_cpu() - b0, 3)
        return out

    def describe(self) -> dict:
        return {"kind": "jetstream", "cipher": self.cipher, "nats_server_pid": self.pid,
                "spec_jetstream": {"encryption": self.cipher != CIPHER["plain"],
                                   **({"cipher": self.cipher} if self.cipher != CIPHER["plain"] else {})},
                "streams": self.streams, "frame_rows": self.cfg.frame_rows}

    def rss_bytes(self) -> int:
        return cm.status_bytes(self.pid, "VmRSS") if self.state else 0

    def stop(self) -> None:
        from isbflow.isb.server import stop_embedded

        if self.state is not None:
            stop_embedded(self.dir)
            self.state = None


def redis_store(root: Path, cfg: tp.Config) -> Store:
    """The Redis Streams store: :class:`stores_redis.RedisBenchStore`, its own redis-server on
    127.0.0.1 in ``root / "redis"``; a ``RuntimeError`` when there is no redis-server."""
    from stores_redis import RedisBenchStore

    return RedisBenchStore(root, cfg)


def make_store(kind: str, root: Path, cfg: tp.Config) -> Store:
    """The store of ``kind`` (one of :data:`KINDS`), not started."""
    if kind == "redis":
        return redis_store(root, cfg)
    return JetStreamStore(kind, root, cfg)


# ------------------------------------------------------------------ the run


def rotated(kinds: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``kinds`` rotated by ``r`` (each store takes each place in turn)."""
    k = r % len(kinds)
    return kinds[k:] + kinds[:k]


def run_config(cfg: tp.Config, kinds: list[str], rounds: int, settle: float) -> dict:
    """The ``config`` of a stores result (what :func:`summarize` and :func:`print_table` read)."""
    return {"records": cfg.records, "rounds": rounds, "stores": kinds, "settle_s": settle,
            "frame_rows": cfg.frame_rows, "batch_rows": cfg.batch_rows}


def measure(stores: dict[str, Store], cfg: tp.Config, rounds: int, settle: float, sampler,
            phase: str = "") -> list[dict]:
    """The rounds over the started ``stores`` (module doc), after one fill and one written-through
    batch on each, unreported; the RSS sampler's phases are named after ``phase``."""
    for k, s in stores.items():
        sampler.phase = f"{phase}warmup-{k}"
        s.refill(cfg.records)
        s.bench.warm_through(f"{phase}warmup-through")
    out = []
    for r in range(1, rounds + 1):
        entry: dict = {"round": r, "order": rotated(list(stores), r - 1), "load_average": list(os.getloadavg())}
        for k in entry["order"]:
            s = stores[k]
            sampler.phase = f"{phase}produce-{k}-{r}"
            log(f"round {r}/{rounds}, {k}: publishing {cfg.records} records as frames")
            produce = s.refill(cfg.records)
            log(f"round {r}/{rounds}, {k}: published {produce['records_per_s']} rec/s, server "
                f"{produce['nats_cores']} cores, publisher {produce['publisher_cores']}")
            sampler.phase = f"{phase}settle-{k}-{r}"
            time.sleep(settle)
            a = s.measure_a(f"{phase}A-{k}-{r}", cfg.records)
            entry[k] = {"produce": produce, "A": a}
        out.append(entry)
    return out


def run(cfg: tp.Config, kinds: list[str], rounds: int, settle: float, keep: bool) -> dict:
    result: dict = {"machine": cm.machine(), "load_average_start": list(os.getloadavg()),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "config": run_config(cfg, kinds, rounds, settle), "rounds": []}
    root = Path(tempfile.mkdtemp(prefix="isbflow-bench-stores-"))
    stores = {k: make_store(k, root, cfg) for k in kinds}
    spark = sampler = None
    try:
        spark, result["spark_conf"] = tp.start_spark(TRIGGER)
        sampler = cm.RssSampler(spark.sparkContext._gateway.proc.pid).start()
        for s in stores.values():
            s.start(spark, sampler)
        result["stores"] = {k: s.describe() for k, s in stores.items()}

        # ---- warm-up (not reported): JIT, Python workers; measure() then warms each store
        first = stores[kinds[0]].bench
        sampler.phase = "warmup"
        n = min(cfg.records, 200_000)
        first.run(first.memory(n), "warmup", n)
        result["rounds"] = measure(stores, cfg, rounds, settle, sampler)
        sampler.phase = "end"
        result["nats_server_rss_bytes_at_end"] = {k: s.rss_bytes() for k, s in stores.items()}
    finally:
        cm.undo_all([("RSS sampler", sampler and sampler.stop), ("SparkSession", spark and spark.stop),
                     *((f"{k} store", s.stop) for k, s in stores.items())])
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    result["load_average_end"] = list(os.getloadavg())
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if sampler is not None:
        result["peak_rss_bytes"] = (sampler.peaks.get("all") or {}).get("rss_bytes")
    summarize(result, kinds)
    return result


def _figures(m: dict) -> dict:
    """One store's figures in one round (None where a phase failed)."""
    p, a = m["produce"], m["A"]
    per_m = lambda cpu: round(cpu * 1e6 / p["records"], 3) if cpu is not None and p["records"] else None  # noqa: E731
    return {
        "publish_records_per_s": p.get("records_per_s"),
        "a_records_per_s": a.get("records_per_s"),
        "a_steady_records_per_s": a.get("steady_records_per_s"),
        "publish_nats_cpu_s_per_m": per_m(p.get("nats_cpu_s")),
        "read_nats_cpu_s_per_m": per_m(a.get("nats_cpu_s")) if "error" not in a else None,
        "store_bytes_per_record": round(p["store_bytes"] / p["records"], 1) if p["records"] else None,
        # Redis only: the dataset it holds in memory after the fill
        "server_memory_bytes_per_record": (round(p["server_dataset_bytes"] / p["records"], 1)
                                           if p.get("server_dataset_bytes") and p["records"] else None),
        "publish_nats_cores": p.get("nats_cores"),
        "publisher_cores": p.get("publisher_cores"),
        "read_spark_cpu_s_per_m": per_m(a.get("spark_cpu_s")) if "error" not in a else None,
    }


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(r: dict, kinds: list[str]) -> None:
    figures = {k: [_figures(e[k]) for e in r["rounds"] if k in e] for k in kinds}
    r["summary"] = {k: {f: _median(x[f] for x in rows) for f in rows[0]} if rows else {}
                    for k, rows in figures.items()}
    for k in kinds:
        r["summary"][k]["complete"] = all(e[k]["A"].get("complete") for e in r["rounds"] if k in e)
        r["summary"][k]["encryption_as_specified"] = all(
            e[k]["produce"].get("encryption_as_specified") for e in r["rounds"] if k in e)
    base = "plain"
    if base not in kinds:
        r["ratios"] = r["ratios_per_round"] = None
        return
    r["ratios"] = {k: {f: tp.ratio(r["summary"][k].get(f), r["summary"][base].get(f)) for f, _, _ in FIGURES}
                   for k in kinds if k != base}
    r["ratios_per_round"] = {k: {f: [tp.ratio(x[f], b[f]) for x, b in zip(figures[k], figures[base], strict=True)]
                                 for f, _, _ in FIGURES}
                             for k in kinds if k != base}
    r["ratio_basis"] = (
        "ratios: each store's median over the rounds divided by plain's median; "
        "ratios_per_round: the same figure over plain's in the same round. Rates: records published "
        "(acked) per second; A whole = records / wall seconds of the query, steady = batches >= 1 from "
        "Spark's progress. Costs: CPU seconds (user + system, /proc) of the store's server (nats-server, "
        "redis-server; keys named nats_*) per 1M records published or read, and the store's bytes on disk "
        "after publishing.")
    r["notes"] = [
        "Every store gets the same records (bench/_common.records), the same frames "
        f"({r['config']['frame_rows']} rows), the same Spark session and the same query; only the "
        "store differs: JetStream not encrypted, encrypted with chachapoly, with aes; Redis Streams.",
        "Each round deletes and recreates the edge's streams before publishing, so every A reads "
        "exactly the round's records from a fresh checkpoint into a fresh Delta table.",
        f"A starts {r['config']['settle_s']:g} s after the publish ends (settle_s): nats-server drops its "
        "cache of the blocks it wrote after a few seconds, so A reads them back from the files (the page "
        "cache holds them: the read costs CPU, not disk), decrypting what is encrypted.",
        "The order is rotated each round so that each store takes each place once per as many rounds "
        "as there are stores.",
        "The machine is shared: compare ratios within one run; absolute seconds vary with the load "
        "averages recorded at start, each round and end.",
    ]
    if "redis" in kinds:
        r["notes"] += [
            "redis: frames written with RedisBuffer.write (the idempotent write script), 64 frames a call "
            "(at most 4 MiB), one call at a time, ids by position (no payload digest); A reads them 32 "
            "frames a call (isbflow.isb.redis.partitions.READ_FRAMES). Redis keeps the buffers in memory: "
            "the settle wait changes nothing for it. Redis has no encryption at rest.",
            "redis: store_bytes is the append-only directory as Redis leaves it after a fill (written and "
            "fsynced, never rewritten by the bench): it still holds earlier fills and the deletes of their "
            "streams until Redis rewrites it on its own (auto-aof-rewrite-percentage), or only the part "
            "written since its last rewrite, so it is not this fill's size; in rounds beside it: "
            "store_bytes_added (the fill's growth; None when Redis rewrote the file during the fill), "
            "aof_rewrites and server_dataset_bytes (the dataset in memory, per record in the summary).",
        ]


def print_table(r: dict) -> None:
    s = r["summary"]
    kinds = list(s)
    print(f"\nmedian over {r['config']['rounds']} round(s) of {r['config']['records']:,} records")
    print(f"{'':<40}" + "".join(f"{k:>14}" for k in kinds))
    for f, label, _ in FIGURES:
        print(f"{label:<40}" + "".join(f"{_shown(s[k].get(f)):>14}" for k in kinds))
    print(f"{'server cores while publishing':<40}" + "".join(f"{_shown(s[k].get('publish_nats_cores')):>14}"
                                                         for k in kinds))
    print(f"{'publisher cores while publishing':<40}" + "".join(f"{_shown(s[k].get('publisher_cores')):>14}"
                                                            for k in kinds))
    print(f"{'server memory bytes per record (Redis)':<40}"
          + "".join(f"{_shown(s[k].get('server_memory_bytes_per_record')):>14}" for k in kinds))
    print(f"{'every A complete, encryption as spec':<40}"
          + "".join(f"{str(s[k]['complete']) + '/' + str(s[k]['encryption_as_specified']):>14}" for k in kinds))
    if r.get("ratios"):
        print("\nstore / plain (ratio of medians; per round in brackets)")
        for k, rat in r["ratios"].items():
            print(f"  {k}:")
            for f, label, _ in FIGURES:
                per = ", ".join(_shown(x) for x in r["ratios_per_round"][k][f])
                print(f"    {label:<40} {_shown(rat[f]):>8}  [{per}]")


def _shown(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:g}"


def main() -> None:
    cm.stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (40,000 records, 2 rounds): checks the harness")
    ap.add_argument("--records", type=int, help="records published into each store each round (default 5,000,000)")
    ap.add_argument("--rounds", type=int, help="rounds over every store (default 3; quick 2)")
    ap.add_argument("--stores", default=",".join(DEFAULT_KINDS),
                    help=f"comma-separated, of {', '.join(KINDS)} (default {','.join(DEFAULT_KINDS)}; "
                         "plain is the base of the ratios)")
    ap.add_argument("--settle", type=float,
                    help="seconds between publishing and reading, for the server to drop its cache of what it "
                         "wrote (default 12; quick 1)")
    ap.add_argument("--out", default=str(tp.BENCH / "results" / "stores.json"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary data dirs")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    if not kinds or len(set(kinds)) != len(kinds) or set(kinds) - set(KINDS):
        ap.error(f"--stores {args.stores}: name each of {', '.join(KINDS)} at most once")
    records = args.records or (40_000 if args.quick else 5_000_000)
    rounds = args.rounds or (2 if args.quick else 3)
    cfg = tp.Config(records=records, events=0, live_seconds=0, live_rate=0, live_rate_high=0, trigger=TRIGGER,
                    json_files=0, frame_rows=tp.frame_rows(records))
    try:
        for k in kinds:
            make_store(k, Path(tempfile.gettempdir()), cfg)  # constructs nothing on disk: refuses early
    except (NotImplementedError, RuntimeError) as e:
        ap.error(str(e))
    settle = args.settle if args.settle is not None else (1.0 if args.quick else 12.0)
    cm.write_result(run(cfg, kinds, rounds, settle, args.keep), args.out, print_table)


if __name__ == "__main__":
    main()
