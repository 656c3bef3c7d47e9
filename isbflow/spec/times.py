"""Time expressions of replay ranges (``replays[].fromTime``/``toTime``, the replay DAG's form).

A replay that runs on a schedule names its range relative to the run, so one
spec entry ("every night at 02:00, reprocess yesterday") serves every night.
An expression is resolved against the run's **reference time** ``end`` (the
Airflow run's data interval end; for a manual run, when it was triggered) and
``start`` (the data interval start; ``end`` when the interval is empty), never
against the wall clock: re-running last night's run replays the same range.
All times are UTC.

Accepted forms:

============================  ===============================================
``2024-05-01``                an absolute date (midnight UTC)
``2024-05-01T06:30:00Z``      an absolute ISO-8601 time (no zone: UTC)
``end`` or ``now``            the reference time
``start``                     the data interval start
``today``                     midnight UTC that begins ``end``'s day
``yesterday``                 ``today`` minus one day
``-1d``, ``-2h30m``, ``+15m``  the reference time plus a signed duration
``today-7d``, ``start-1h``    an anchor above plus a signed duration
============================  ===============================================

Durations are the spec's Go-style ones (``30s``, ``15m``, ``2h``, ``1d``,
``1h30m``). A range's ``from`` must lie before its ``to``
(:func:`resolve_range` checks it). Example, a nightly reprocess of yesterday::

    replays:
      - name: nightly
        mode: reprocess
        schedule: "0 2 * * *"
        fromTime: yesterday
        toTime: today

This module imports neither Airflow nor Spark.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

ANCHORS = ("now", "end", "start", "today", "yesterday")
_EXPR = re.compile(r"^(?P<anchor>[a-z]+)?\s*(?:(?P<sign>[+-])\s*(?P<duration>[0-9][0-9a-zµ.]*))?$")
HELP = ("a time such as '2024-05-01', '2024-05-01T06:30:00Z', 'yesterday', 'today', 'start', 'end', "
        "'-1d' or 'today-6h'")


class TimeExpressionError(ValueError):
    """A time expression that is none of the accepted forms; the message names it and the forms."""


def _absolute(text: str) -> datetime | None:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h|d)")
_DURATION_UNITS = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0,
}


#: the longest duration a spec may hold (ten years): beyond it a value is a typo, and NATS' own
#: limits (nanoseconds in an int64) end at 292 years
MAX_DURATION = 10 * 365 * 86400.0


def _bounded(seconds: float, value: Any) -> float:
    if not seconds <= MAX_DURATION:
        raise ValueError(f"must be at most 3650d (ten years), got {_short(value)}")
    return seconds


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_duration(value: Any) -> float:
    """``"1m30s"`` -> 90.0; numbers are seconds. Raises ValueError with the rule."""
    if isinstance(value, bool):
        raise ValueError("must be a duration such as '30s', '2m' or '72h'")
    if isinstance(value, int | float):
        if value != value or value in (float("inf"), float("-inf")):  # .nan, .inf
            raise ValueError(f"must be a finite duration, got {value!r}")
        if value < 0:
            raise ValueError("must be >= 0")
        return _bounded(float(value), value)
    if isinstance(value, str):
        text = value.strip()
        if text in ("0", ""):
            return 0.0
        pos, total = 0, 0.0
        for m in _DURATION_RE.finditer(text):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos = m.end()
        if pos == len(text) and pos > 0:
            return _bounded(total, value)
    raise ValueError(f"must be a duration such as '30s', '2m' or '72h', got {_short(value)}")


def _parse(text: str) -> tuple[datetime | None, str | None, float]:
    """(absolute time, or anchor and signed offset in seconds); TimeExpressionError if neither."""
    value = _absolute(text)
    if value is not None:
        return value, None, 0.0
    m = _EXPR.match(text.strip().lower())
    if m is None or not (m.group("anchor") or m.group("duration")):
        raise TimeExpressionError(f"{text!r} is not {HELP}")
    anchor = m.group("anchor") or "end"
    if anchor not in ANCHORS:
        raise TimeExpressionError(f"{text!r}: unknown anchor {anchor!r} (anchors: {', '.join(ANCHORS)}); "
                                  f"use {HELP}")
    offset = 0.0
    if m.group("duration"):
        try:
            offset = parse_duration(m.group("duration"))
        except ValueError:
            raise TimeExpressionError(f"{text!r}: {m.group('duration')!r} is not a duration such as "
                                      "'30m', '6h' or '1d'") from None
        offset = -offset if m.group("sign") == "-" else offset
    return None, anchor, offset


def check_time_expression(text: str) -> str:
    """``text`` unchanged when it is an accepted form, else TimeExpressionError (for spec validation)."""
    if not isinstance(text, str) or not text.strip():
        raise TimeExpressionError(f"must be {HELP}")
    _parse(text)
    return text


def resolve_time(text: str, end: datetime, start: datetime | None = None) -> datetime:
    """The UTC time ``text`` names for a run whose data interval is ``start``..``end``."""
    end = end.astimezone(UTC) if end.tzinfo else end.replace(tzinfo=UTC)
    start = end if start is None else (start.astimezone(UTC) if start.tzinfo else start.replace(tzinfo=UTC))
    value, anchor, offset = _parse(text)
    if value is not None:
        return value
    today = end.replace(hour=0, minute=0, second=0, microsecond=0)
    base = {"now": end, "end": end, "start": start, "today": today, "yesterday": today - timedelta(days=1)}[anchor]
    return base + timedelta(seconds=offset)


def resolve_range(from_text: str | None, to_text: str | None, end: datetime,
                  start: datetime | None = None) -> tuple[datetime | None, datetime | None]:
    """Both bounds resolved (``None`` stays open); TimeExpressionError when ``from`` is not before ``to``."""
    lo = resolve_time(from_text, end, start) if from_text else None
    hi = resolve_time(to_text, end, start) if to_text else None
    if lo is not None and hi is not None and lo >= hi:
        raise TimeExpressionError(f"the range from {from_text!r} ({lo.isoformat()}) to {to_text!r} "
                                  f"({hi.isoformat()}) is empty: 'from' must lie before 'to'")
    return lo, hi
