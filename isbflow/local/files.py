"""Local files that grow with a long run: bounded reads of logs, keeping the newest few, rotation.

:func:`tail` reads at most the last ``max_bytes`` of a file, never the whole
log; :func:`keep_newest` removes all but the newest ``keep`` of a set of files
or folders (a driver's launch logs, a recovery's checkpoints moved aside);
:func:`rotate_log` bounds one log that its writers keep open.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

#: how much of a log's end :func:`tail` reads
TAIL_BYTES = 64 * 1024
#: a driver's log is rotated past this size (:func:`rotate_log`): with its one older part, 2x this at most
LOG_MAX_BYTES = 16 * 1024 * 1024
#: the suffix of a rotated log's older part
ROTATED_SUFFIX = ".1"


def tail(path: str | Path, lines: int = 20, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``lines`` lines of a text file, from its last ``max_bytes`` at most ('' when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read(max_bytes).decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def keep_newest(paths: Iterable[str | Path], keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest (by modification time, then name) of ``paths``, files or
    folders; the paths removed. One already gone is skipped."""
    dated = []
    for p in map(Path, paths):
        try:
            dated.append((p.stat().st_mtime, p.name, p))
        except FileNotFoundError:
            continue
    dated.sort(reverse=True)
    removed = []
    for _, _, p in dated[max(0, keep):]:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def rotate_log(path: str | Path, max_bytes: int = LOG_MAX_BYTES) -> bool:
    """When ``path`` is over ``max_bytes``: copy it to ``<path>.1`` (replacing the older part) and
    truncate it to zero (logrotate's ``copytruncate``); whether it did. Its writers (a driver's
    stdout and stderr, the JVM's too) hold it open in append mode, so they go on at its new end:
    a log is at most ``max_bytes`` plus what is written between two calls, twice with its older
    part. Lines written between the copy and the truncation are lost (microseconds' worth)."""
    try:
        if os.path.getsize(path) <= max_bytes:
            return False
        shutil.copyfile(path, f"{path}{ROTATED_SUFFIX}")
        os.truncate(path, 0)
    except FileNotFoundError:
        return False
    return True
