"""Commit metadata too large for the Delta log, kept in a file beside it.

A fold (:mod:`isbflow.sinks.delta_log`) carries the offsets a sink holds and the claims ``quality
verify`` checks. For a sink fed by a filtering edge (the error events of a log stream, say) those
are one range per record, scattered among the source's offsets, so the fold would grow with the
table and every copy of it the log keeps would too. Above :data:`INLINE_BYTES` the fold keeps them
in ``<table>/_isb_fold/<name>.json`` (written whole before the fold commits; a folder whose name
starts with ``_`` is hidden to every Delta reader and to VACUUM) and names the file and its SHA-256
in its metadata instead; :func:`expand` puts them back into the commit's metadata as it is read
(:func:`isbflow.local.delta.table_history`), so every reader answers from the same keys either way.
The trim removes a file once no commit of the log names it (:func:`prune`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

#: the commit metadata keys naming the file and its digest
FILE_KEY = "isb.fold.file"
DIGEST_KEY = "isb.fold.sha256"
#: the folder beside ``_delta_log``
FOLDER = "_isb_fold"
#: metadata values larger than this (bytes, together) go to a file
INLINE_BYTES = 16 * 1024
#: an unnamed file younger than this is kept (a fold writes it before its commit lands)
PRUNE_AGE_S = 600.0


class SidecarMissing(LookupError):
    """A commit names a metadata file that is gone or altered."""


def write(table_root: Path, name: str, values: Mapping[str, str]) -> dict[str, str]:
    """``values`` written to ``<table_root>/_isb_fold/<name>.json`` (atomically); the metadata that
    names it."""
    folder = Path(table_root) / FOLDER
    folder.mkdir(exist_ok=True)
    body = json.dumps(dict(values), separators=(",", ":"), sort_keys=True).encode()
    tmp = folder / f".{name}.json.{os.getpid()}.tmp"
    tmp.write_bytes(body)
    os.replace(tmp, folder / f"{name}.json")
    return {FILE_KEY: f"{FOLDER}/{name}.json", DIGEST_KEY: hashlib.sha256(body).hexdigest()}


def expand(table_root: Path, info: dict) -> dict:
    """``info`` (a commit's metadata) with the values of the file it names, if it names one."""
    rel = info.get(FILE_KEY)
    if not rel:
        return info
    path = Path(table_root) / rel
    try:
        body = path.read_bytes()
    except FileNotFoundError:
        raise SidecarMissing(f"{path}: the fold of version {info.get('version', '?')} keeps its offsets and claims "
                             "in this file, which is gone; the sink's history before that fold cannot be read "
                             "(rebuild the ledger from the offsets KV, or reprocess)") from None
    if hashlib.sha256(body).hexdigest() != info.get(DIGEST_KEY):
        raise SidecarMissing(f"{path}: the file does not match the digest its fold recorded")
    return {**info, **json.loads(body)}


def prune(table_root: Path, named: Iterable[str], now: float | None = None) -> list[str]:
    """The files of ``_isb_fold`` no commit names (``named``: their ``isb.fold.file`` values) and
    older than :data:`PRUNE_AGE_S`, removed; their names."""
    folder = Path(table_root) / FOLDER
    if not folder.is_dir():
        return []
    keep = {Path(n).name for n in named if n}
    now = time.time() if now is None else now
    removed = []
    for f in folder.iterdir():
        if f.name in keep or not f.is_file():
            continue
        try:
            if now - f.stat().st_mtime >= PRUNE_AGE_S:
                f.unlink()
                removed.append(f.name)
        except FileNotFoundError:
            pass
    return removed
