"""frames/s of the Redis store's idempotent write vs a plain XADD, 4 KiB frames, on an embedded redis-server.

    python bench/redis_write.py [FRAMES]      # default 20,000

Starts its own redis-server in a temporary folder (stopped by PID at the end), writes FRAMES frames
plainly (XADD) and through the store's idempotent script, one per round trip, pipelined and batched,
and prints frames/s with the server's and the client's CPU per frame (from /proc).
"""
import asyncio
import os
import shutil
import sys
import tempfile
import time

import redis

from isbflow.isb.redis import scripts, server
from isbflow.isb.redis.buffers import RedisBuffer
from isbflow.isb.redis.client import connect
from isbflow.isb.redis.keys import BufferKeys
from isbflow.isb.store import OutFrame

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
PIPE = 64
payload = os.urandom(4096)
d = tempfile.mkdtemp()
st = server.start_redis(d)  # appendonly yes, appendfsync everysec
r = redis.Redis(host=server.HOST, port=st.port, password=st.password)
sha = r.script_load(scripts.WRITE)

def cpu(pid):  # utime+stime in seconds
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

def timed(name, fn, key):
    r.delete(*BufferKeys(key).all)
    s0, c0, t0 = cpu(st.pid), time.process_time(), time.perf_counter()
    fn(BufferKeys(key))
    wall = time.perf_counter() - t0
    server_cpu, client_cpu = cpu(st.pid) - s0, time.process_time() - c0
    assert r.xlen(BufferKeys(key).stream) == N
    print(f"{name:44s} {N / wall:9,.0f} frames/s  CPU per frame: server {server_cpu / N * 1e6:5.1f} us, "
          f"client {client_cpu / N * 1e6:5.1f} us")

def xadd(k):
    for i in range(N):
        r.xadd(k.stream, {"id": f"f{i}", "rows": 1, "f": payload})

def xadd_pipelined(k):
    for s in range(0, N, PIPE):
        p = r.pipeline(transaction=False)
        for i in range(s, min(N, s + PIPE)):
            p.xadd(k.stream, {"id": f"f{i}", "rows": 1, "f": payload})
        p.execute()

def script(k):
    for i in range(N):
        r.evalsha(sha, 3, *k.all, "inc", 0, f"f{i}", 1, payload)

def script_pipelined(k):
    for s in range(0, N, PIPE):
        p = r.pipeline(transaction=False)
        for i in range(s, min(N, s + PIPE)):
            p.evalsha(sha, 3, *k.all, "inc", 0, f"f{i}", 1, payload)
        p.execute()

def script_batched(k):
    for s in range(0, N, PIPE):
        args = ["inc", 0]
        for i in range(s, min(N, s + PIPE)):
            args += [f"f{i}", 1, payload]
        r.evalsha(sha, 3, *k.all, *args)

def store_write(k):  # RedisBuffer.write: the batched script on redis.asyncio, 64 frames a call
    async def go():
        c = connect(d)
        b = RedisBuffer(c, k.name)
        for s in range(0, N, 1024):
            await b.write([OutFrame(f"f{i}", payload, 1) for i in range(s, min(N, s + 1024))])
        await c.aclose()
    asyncio.run(go())

try:
    for name, fn in [("XADD, one per round trip", xadd), (f"XADD, pipelined {PIPE}", xadd_pipelined),
                     ("idempotent script, one per round trip", script),
                     (f"idempotent script, pipelined {PIPE}", script_pipelined),
                     (f"idempotent script, {PIPE} frames per call", script_batched),
                     ("RedisBuffer.write (asyncio, 64 per call)", store_write)]:
        timed(name, fn, f"bench-{fn.__name__}")
    # a second write of the same frames: every one a duplicate, nothing appended
    k = BufferKeys("bench-script_batched")
    t0 = time.perf_counter()
    script_batched(k)
    wall = time.perf_counter() - t0
    assert r.xlen(k.stream) == N
    print(f"{'duplicates, ' + str(PIPE) + ' frames per call':44s} {N / wall:9,.0f} frames/s")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; redis-server "
          f"{r.info('server')['redis_version']}, redis-py {redis.__version__}")
finally:
    r.close()
    server.stop_redis(d)
    shutil.rmtree(d, ignore_errors=True)
