"""The last recovery as ``isbflow pipeline status`` and the UI's Pipelines page show it.

:func:`isbflow.recovery.recover.recover` keeps its report current in the
pipeline's status bucket (key ``recovery``) as each phase ends.
"""

from __future__ import annotations

import json
import socket
import time

from isbflow.isb import naming
from isbflow.isb.control import kv as open_kv
from isbflow.isb.store import BucketMissing
from isbflow.local.procs import process_alive

#: a recovery run on another host (its process cannot be checked) that published no phase for
#: this long counts as killed midway. Generous: a replay phase publishes only when it ends, and
#: starting a second recovery beside a live one is worse than waiting to start one.
STUCK_AFTER_S = 3600.0


def is_running(r: dict | None, now: float | None = None) -> bool:
    """Whether the recovery ``r`` still runs: its state says ``running`` and its process is alive
    (on this host), or, run on another host, it published a phase within :data:`STUCK_AFTER_S`.
    A recover killed midway leaves ``running`` behind; this tells it from a live one."""
    if not r or r.get("state") != "running":
        return False
    if r.get("pid") and r.get("host") == socket.gethostname():
        return process_alive(int(r["pid"]))
    now = time.time() if now is None else now
    return now - float(r.get("updated_at") or 0) <= STUCK_AFTER_S


async def last_recovery(nc, pipeline: str) -> dict | None:
    """The last recovery's report (``isbflow replay --mode recover`` keeps it current), or None."""
    try:
        raw = await (await open_kv(nc, naming.status_bucket(pipeline))).get("recovery")
    except BucketMissing:
        return None
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def recovery_line(r: dict, now: float | None = None) -> str:
    """One paragraph on the last recovery: state, what was lost, each phase with its seconds."""
    now = time.time() if now is None else now
    lost = ", ".join(b.get("stream", "?") for b in r.get("lost") or []) or "nothing"
    phases = ", ".join(f"{ph['name']} {ph['state']} {ph['seconds']:.1f}s" for ph in r.get("phases") or [])
    age = f" (last update {now - r['updated_at']:.0f}s ago)" if r.get("updated_at") else ""
    state = r.get("state", "?")
    line = f"last recovery: {state}{age}; lost: {lost}; phases: {phases or 'none yet'}"
    if state == "recovered":
        line += f"; {r.get('replayed_records', 0)} records replayed in {r.get('seconds', 0):.1f}s"
    elif state == "running" and not is_running(r, now):
        line += ("; its process is gone (killed midway?): run 'isbflow replay --mode recover' again "
                 "(recovery is idempotent)")
    elif state == "failed":
        line += "; fix what the failed phase names, then run 'isbflow replay --mode recover' again"
    return line
