"""Quality reports on disk: one JSON file and one Data Docs page per run, history, retention.

Layout under ``<data dir>/quality/reports``::

    <pipeline>/<sink>/<run id>.json    the report (see run.QualityReport.to_dict)
    <pipeline>/<sink>/<run id>.html    its GX Data Docs page, assets local
    _static/                           GX's images/fonts/styles + isbflow-docs.css

Run ids are ``YYYYmmddTHHMMSSffffffZ-<6 hex>`` (UTC): sorting them sorts runs
by time. :func:`report_path` is the one way to turn names from outside (an
HTTP request of the Airflow plugin) into a path: it refuses anything that
would leave the reports folder (``..``, absolute paths, backslashes, NUL, and
the same percent-encoded once or several times) with :class:`UnsafeReportPath`.
:func:`prune` applies a sink's retention after each run; every pruned run is
logged and returned, so the run's report names it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from isbflow.spec.paths import DataDir

log = logging.getLogger(__name__)

_RUN_ID = re.compile(r"^(\d{8}T\d{12}Z)-[0-9a-f]{6}$")


class UnsafeReportPath(ValueError):
    """A requested report path would leave the reports folder."""


def reports_root(data_dir: str | Path) -> Path:
    return DataDir(data_dir).quality_reports


def new_run_id(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ") + "-" + secrets.token_hex(3)


def run_time(run_id: str) -> datetime | None:
    m = _RUN_ID.match(run_id)
    return datetime.strptime(m.group(1), "%Y%m%dT%H%M%S%fZ").replace(tzinfo=UTC) if m else None


def report_path(data_dir: str | Path, *parts: str) -> Path:
    """``<reports>/<parts...>`` when it stays inside the reports folder, else UnsafeReportPath.

    Each part may hold ``/`` separators (``"_static/styles/x.css"``). Parts are
    percent-decoded until stable before checking, so ``%2e%2e`` and
    ``%252e%252e`` are refused like ``..``.
    """
    root = reports_root(data_dir).resolve()
    segments: list[str] = []
    for part in parts:
        if not isinstance(part, str) or not part:
            raise UnsafeReportPath(f"empty or non-text report path part {part!r}")
        text = part
        for _ in range(5):
            decoded = unquote(text)
            if decoded == text:
                break
            text = decoded
        else:
            raise UnsafeReportPath(f"report path {part!r} is encoded too many times")
        if "\\" in text or "\x00" in text or text.startswith("/") or re.match(r"^[A-Za-z]:", text):
            raise UnsafeReportPath(f"report path {part!r} must be relative, without '\\' or NUL")
        for seg in text.split("/"):
            if seg in ("", ".", ".."):
                raise UnsafeReportPath(f"report path {part!r} may not contain '..', '.' or empty segments")
            segments.append(seg)
    path = root.joinpath(*segments)
    resolved = path.resolve()
    if resolved != root and root not in resolved.parents:  # e.g. a symlink pointing out
        raise UnsafeReportPath(f"report path {'/'.join(parts)!r} leaves the reports folder")
    return resolved


def save_report(data_dir: str | Path, report: dict[str, Any], docs_html: str | None) -> Path:
    """Write ``<run id>.json`` (and ``.html``) atomically; return the JSON path."""
    folder = report_path(data_dir, report["pipeline"], report["sink"])
    folder.mkdir(parents=True, exist_ok=True)
    if docs_html is not None:
        _atomic_write(folder / f"{report['run_id']}.html", docs_html)
    target = folder / f"{report['run_id']}.json"
    _atomic_write(target, json.dumps(report, indent=2, default=str))
    return target


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _run_files(data_dir: str | Path, pipeline: str, sink: str) -> list[Path]:
    folder = report_path(data_dir, pipeline, sink)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.glob("*.json") if _RUN_ID.match(p.stem)), key=lambda p: p.stem, reverse=True)


def list_reports(data_dir: str | Path, pipeline: str, sink: str | None = None) -> list[dict[str, Any]]:
    """Reports of a pipeline (of one sink), newest first, as stored (plus ``report_file``).

    A report file that cannot be read is listed with ``error`` rather than hidden.
    """
    if sink is None:
        base = report_path(data_dir, pipeline)
        sinks = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    else:
        sinks = [sink]
    out: list[dict[str, Any]] = []
    for s in sinks:
        for f in _run_files(data_dir, pipeline, s):
            try:
                report = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                report = {"pipeline": pipeline, "sink": s, "run_id": f.stem, "error": f"unreadable report: {e}"}
            report["report_file"] = str(f.relative_to(reports_root(data_dir).resolve()))
            out.append(report)
    out.sort(key=lambda r: str(r.get("run_id")), reverse=True)
    return out


def prune(data_dir: str | Path, pipeline: str, sink: str, keep_runs: int | None, max_age: float | None,
          now: datetime, protect: str | None = None) -> list[str]:
    """Remove runs beyond the newest ``keep_runs`` or older than ``max_age`` seconds; return their ids.

    ``protect`` (the run just written) is never removed. Each removal is logged.
    """
    pruned: list[str] = []
    oldest = now - timedelta(seconds=max_age) if max_age is not None else None
    for i, f in enumerate(_run_files(data_dir, pipeline, sink)):
        run_id = f.stem
        if run_id == protect:
            continue
        t = run_time(run_id)
        too_many = keep_runs is not None and i >= keep_runs
        too_old = oldest is not None and t is not None and t < oldest
        if too_many or too_old:
            for p in (f, f.with_suffix(".html")):
                p.unlink(missing_ok=True)
            why = f"beyond the newest {keep_runs} runs" if too_many else f"older than {max_age:g} s"
            log.info("quality: pruned report %s/%s/%s (%s)", pipeline, sink, run_id, why)
            pruned.append(run_id)
    return pruned
