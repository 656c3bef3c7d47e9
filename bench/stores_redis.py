"""The Redis Streams store of bench/stores.py (``--stores redis``): measurement A on an embedded redis-server.

:class:`RedisBenchStore` runs its own redis-server on 127.0.0.1 in its data dir ``<root>/redis``
(:func:`isbflow.isb.redis.server.start_redis`, the append-only file on, ``appendfsync everysec``:
what ``redis: {native: {persistence: true}}`` starts), provisions the bench pipeline on it as
``isbflow isb apply`` does (:func:`isbflow.isb.redis.provision.apply` of the pipeline's grant, as
the admin), and stops it by PID (:func:`isbflow.isb.redis.server.stop_redis`). The spec is
bench/throughput.py's with its ISB service on Redis (:func:`redis_spec`); Spark reads the edge's
partitions with the same ``write_through.FORMAT`` reader, handed the store's
:class:`isbflow.isb.settings.RedisSettings` (the admin's password).

A fill (:meth:`RedisBenchStore.refill`): the edge's two partition streams are deleted and created
again empty (``RedisBuffer.delete`` then ``create``, not timed), then the records of
``throughput.publish_frames`` are cut into the same frames (``frames.split_frames``) and written
with ``RedisBuffer.write`` (the idempotent write script) in calls of :data:`WRITE_FRAMES` frames,
the frames dealt round-robin over the partitions as ``publish_frames`` deals them, one call at a
time (timed). Frame ids are positions (``frames.frame_id`` without the payload digest: the
JetStream publish sends no message id). Redis has no encryption at rest: ``encryption_as_specified``
is true with nothing to check.

``store_bytes`` is the size of the append-only files (``<data dir>/redis/appendonly``) as Redis
leaves them once it has written and synced what it was sent (``INFO persistence``:
``aof_buffer_length`` and ``aof_pending_bio_fsync`` at 0, no rewrite running): the bench never
rewrites it, so it holds the frames of earlier fills and the deletes of their streams until Redis
rewrites the file on its own (``auto-aof-rewrite-percentage``: the file grew by its size at the last
rewrite, and past 64 MB), and then only what was written since. ``aof_rewrites`` counts the
rewrites Redis ran during the fill, ``store_bytes_added`` is what the fill added (None when a rewrite
ran), ``server_dataset_bytes`` the dataset Redis holds in memory (``used_memory_dataset``).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import _common as cm
import stores as st
import throughput as tp
from _common import log
from soak import tree_cpu_seconds

#: frames per ``RedisBuffer.write`` call (as a step's writer hands a store: ``task_publisher.STORE_WRITE_FRAMES``)
WRITE_FRAMES = 64
#: seconds to wait after a fill for Redis to have written and synced its append-only file
AOF_SETTLE_TIMEOUT = 120.0
#: the ISB service of :func:`redis_spec`, in place of bench/_common.ISB_SERVICE_YAML's spec
REDIS_SERVICE_SPEC = "spec:\n  redis:\n    native:\n      persistence: true\n---\n"


def redis_spec() -> str:
    """bench/throughput.py's spec with its ISB service (``default``) on Redis: ``redis: {native:
    {persistence: true}}`` in place of its ``jetstream`` block."""
    head, sep, _ = cm.ISB_SERVICE_YAML.partition("spec:\n")
    if not sep or cm.ISB_SERVICE_YAML not in tp.SPEC:
        raise RuntimeError("bench/_common.ISB_SERVICE_YAML changed: redis_spec no longer finds the service's spec")
    return tp.SPEC.replace(cm.ISB_SERVICE_YAML, head + REDIS_SERVICE_SPEC)


async def _info(client, section: str) -> dict:
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in (await client.info(section)).items()}


async def aof_settled(client, timeout: float = AOF_SETTLE_TIMEOUT) -> dict:
    """``INFO persistence`` once Redis has written and synced its append-only file (no buffered
    writes, no pending fsync, no rewrite running or scheduled), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        info = await _info(client, "persistence")
        busy = [k for k in ("aof_buffer_length", "aof_pending_bio_fsync", "aof_rewrite_in_progress",
                            "aof_rewrite_scheduled") if int(info.get(k) or 0)]
        if not busy or time.monotonic() > deadline:
            info["settled"] = not busy
            return info
        await asyncio.sleep(0.1)


class RedisBenchStore(st.Store):
    """An embedded redis-server in its own data dir ``root / "redis"`` (module doc)."""

    def __init__(self, root: Path, cfg: tp.Config):
        from isbflow.isb.redis.server import EmbeddedRedisError, redis_server_binary

        try:
            redis_server_binary()  # refuses early, before Spark starts
        except EmbeddedRedisError as e:
            raise RuntimeError(f"--stores redis: {e}") from None
        self.kind, self.cfg = "redis", cfg
        self.dir = root / "redis"
        self.state = None

    def start(self, spark, sampler) -> None:
        from isbflow.connector.task_publisher import STORE_MAX_PAYLOAD
        from isbflow.isb import naming
        from isbflow.isb.redis.acl import ADMIN, password_file
        from isbflow.isb.redis.server import start_redis
        from isbflow.isb.settings import RedisSettings
        from isbflow.spec import load_specs

        self.dir.mkdir(parents=True)
        (self.dir / "spec.yaml").write_text(redis_spec())
        self.specs = load_specs(self.dir / "spec.yaml")
        self.p = self.specs.only_pipeline()
        native = self.specs.service_for(self.p).spec.redis.native
        self.persistence, self.fsync = ("aof" if native.persistence else "none"), native.fsync
        self.state = start_redis(self.dir, persistence=self.persistence, fsync=self.fsync)
        self.pid = self.state.pid
        self.settings = RedisSettings(url=f"redis://127.0.0.1:{self.state.port}/0",
                                      password=password_file(self.dir, ADMIN).read_text().strip())
        self.streams = [ep.stream for ep in naming.edge_partitions(self.p) if ep.to_vertex == "raw"]
        self.max_payload = STORE_MAX_PAYLOAD  # a step cuts frames for Redis at this size
        self.version = asyncio.run(self._with_store(self._provision))
        self.bench = tp.Bench(self.cfg, self.dir, spark, self.settings, self.specs, sampler)
        log(f"{self.kind}: redis-server {self.version} pid {self.pid}, port {self.state.port}, "
            f"persistence {self.persistence} (appendfsync {self.fsync}), at {self.dir}")

    async def _with_store(self, work):
        from isbflow.isb.connect import connect

        store = await connect(self.settings, name="bench-stores")  # a RedisStore, as the admin
        try:
            return await work(store.client)
        finally:
            await store.close()

    async def _provision(self, client) -> str:
        from isbflow.isb.redis import provision
        from isbflow.isb.roles import pipeline_grants

        await provision.apply(client, pipeline_grants(self.p), self.dir)
        return (await _info(client, "server")).get("redis_version", "?")

    async def _recreate(self, client) -> dict:
        from isbflow.isb.redis.buffers import RedisBuffer

        for s in self.streams:
            b = RedisBuffer(client, s)
            await b.delete()
            await b.create()
        return await aof_settled(client)

    async def _publish(self, client, total: int) -> dict:
        """Records 0..total-1 as the frames of ``throughput.publish_frames``, round-robin over the
        partitions, written :data:`WRITE_FRAMES` a call, one call at a time."""
        from isbflow.isb import frames
        from isbflow.isb.redis.buffers import RedisBuffer
        from isbflow.isb.store import OutFrame

        bufs = [RedisBuffer(client, s) for s in self.streams]
        pending: list[list[OutFrame]] = [[] for _ in bufs]
        t0, n, encode_s, write_s, calls, stored = cm.now(), 0, 0.0, 0.0, 0, 0

        async def write(k: int) -> None:
            nonlocal write_s, calls, stored
            w0 = cm.now()
            written = await bufs[k].write(pending[k])
            write_s += cm.now() - w0
            calls += 1
            stored += sum(not w.duplicate for w in written)
            pending[k] = []

        for lo in range(0, total, 100_000):
            e0 = cm.now()
            split = frames.split_frames(cm.records(lo, min(total, lo + 100_000)), self.max_payload,
                                        self.cfg.frame_rows)
            encode_s += cm.now() - e0
            for fr in split.frames:
                k = n % len(bufs)
                pending[k].append(OutFrame(frames.frame_id("in", 0, 0, k, n), fr.payload, fr.rows))
                n += 1
                if len(pending[k]) >= WRITE_FRAMES:
                    await write(k)
        for k in range(len(bufs)):
            if pending[k]:
                await write(k)
        s = cm.now() - t0
        if stored != n:
            raise RuntimeError(f"redis: {n} frames written, {stored} stored (the rest taken for duplicates)")
        return {"records": total, "frames": n, "frame_rows": self.cfg.frame_rows, "seconds": round(s, 3),
                "records_per_s": round(total / s, 1), "encode_seconds": round(encode_s, 3),
                "write_seconds": round(write_s, 3), "write_calls": calls}

    async def _after(self, client) -> dict:
        from isbflow.isb.redis.buffers import RedisBuffer

        held = [await RedisBuffer(client, s).state() for s in self.streams]
        return {"persistence": await aof_settled(client), "memory": await _info(client, "memory"),
                "frames_held": sum(h.messages for h in held if h is not None)}

    def _aof_bytes(self) -> int:
        from isbflow.isb.redis.server import redis_dir

        return st._bytes_under(redis_dir(self.dir) / "appendonly")

    def refill(self, records: int) -> dict:
        """The edge's partitions deleted and created again empty (not timed), then ``records`` rows
        written as frames (timed), with the server's and the publisher's CPU over the write."""
        before = asyncio.run(self._with_store(self._recreate))
        bytes0 = self._aof_bytes()
        n0, p0 = st._cpu(self.pid), time.thread_time()
        out = asyncio.run(self._with_store(lambda c: self._publish(c, records)))
        out["nats_cpu_s"] = round(st._cpu(self.pid) - n0, 3)
        out["publisher_cpu_s"] = round(time.thread_time() - p0, 3)
        out["nats_cores"] = round(out["nats_cpu_s"] / out["seconds"], 3)
        out["publisher_cores"] = round(out["publisher_cpu_s"] / out["seconds"], 3)
        after = asyncio.run(self._with_store(self._after))
        if after["frames_held"] != out["frames"]:
            raise RuntimeError(f"redis: the partitions hold {after['frames_held']} frames, {out['frames']} written")
        out["store_bytes"] = self._aof_bytes()
        out["aof_settled"] = after["persistence"]["settled"]
        out["aof_rewrites"] = int(after["persistence"].get("aof_rewrites", 0)) - int(before.get("aof_rewrites", 0))
        # a rewrite replaces the files: what the fill added is then not told apart
        out["store_bytes_added"] = None if out["aof_rewrites"] else out["store_bytes"] - bytes0
        out["server_dataset_bytes"] = int(after["memory"].get("used_memory_dataset", 0))
        out["encryption_as_specified"] = True  # Redis has no encryption at rest: nothing was asked
        return out

    def measure_a(self, name: str, records: int) -> dict:
        """A on this store, as :meth:`stores.JetStreamStore.measure_a` (server CPU: the redis-server's)."""
        n0, s0, b0 = st._cpu(self.pid), tree_cpu_seconds(st._spark_tree()), st._process_cpu()
        out = self.bench.run(self.bench.frames_through(), name, records, sink="through")
        out["nats_cpu_s"] = round(st._cpu(self.pid) - n0, 3)
        out["spark_cpu_s"] = round(tree_cpu_seconds(st._spark_tree()) - s0, 3)
        out["bench_cpu_s"] = round(st._process_cpu() - b0, 3)
        return out

    def describe(self) -> dict:
        from isbflow.isb.redis.partitions import READ_FRAMES

        return {"kind": "redis", "redis_version": self.version, "redis_server_pid": self.pid,
                "port": self.state.port if self.state else None, "persistence": self.persistence,
                "appendfsync": self.fsync, "encryption": "none (Redis has no encryption at rest)",
                "streams": self.streams, "frame_rows": self.cfg.frame_rows, "max_payload": self.max_payload,
                "write_frames_per_call": WRITE_FRAMES, "read_frames_per_call": READ_FRAMES}

    def rss_bytes(self) -> int:
        return cm.status_bytes(self.pid, "VmRSS") if self.state else 0

    def stop(self) -> None:
        from isbflow.isb.redis.server import stop_redis

        if self.state is not None:
            stop_redis(self.dir)
            self.state = None


def server_exe() -> str | None:
    """The file redis-server's processes run (``/proc/<pid>/exe``: Debian's ``redis-server`` is a link
    to ``redis-check-rdb``), or None when there is none."""
    from isbflow.isb.redis.server import EmbeddedRedisError, redis_server_binary

    try:
        return os.path.realpath(redis_server_binary())
    except EmbeddedRedisError:
        return None
