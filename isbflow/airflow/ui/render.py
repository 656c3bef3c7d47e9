"""HTML for the pages: Jinja2 templates (autoescaped) and the rate chart as inline SVG.

Nothing is loaded from outside the api-server: styles and the small refresh
script are inline, the chart is SVG drawn here (and redrawn by the page's
script from the JSON endpoint, with the same scale).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from isbflow.airflow.ui.models import StepView

TEMPLATES = Path(__file__).parent / "templates"
CHART_W, CHART_H, CHART_PAD = 640, 160, 4
WINDOW_S = 3600.0
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")

_env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                          undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


@dataclass
class Series:
    step: str
    color: str
    points: str  # SVG polyline points


def chart(steps: list[StepView], now: float | None = None) -> dict[str, Any]:
    """Processed rows/s of each step over the last hour: polylines on one shared scale.

    x: ``now - WINDOW_S`` .. ``now``; y: 0 .. the largest rate (at least 1).
    """
    now = time.time() if now is None else now
    peak = max([1.0, *(p.processed_rows_per_s for s in steps for p in s.rates)])
    series = []
    for i, s in enumerate(steps):
        pts = []
        for p in s.rates:
            x = CHART_PAD + (CHART_W - 2 * CHART_PAD) * min(1.0, max(0.0, (p.t + 30 - (now - WINDOW_S)) / WINDOW_S))
            y = CHART_H - CHART_PAD - (CHART_H - 2 * CHART_PAD) * p.processed_rows_per_s / peak
            pts.append(f"{x:.1f},{y:.1f}")
        series.append(Series(s.vertex, PALETTE[i % len(PALETTE)], " ".join(pts)))
    return {"w": CHART_W, "h": CHART_H, "peak": peak, "series": series}


def num(x: float | int | None, digits: int = 1) -> str:
    """A plain number for ``data-rate`` cells (no thousands separators: scripts parse it)."""
    if x is None:
        return ""
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def show(value: Any) -> str:
    """A sample value as JSON text (strings quoted, None as null); the template escapes it."""
    return json.dumps(value, ensure_ascii=False, default=str)


def render(template: str, **context: Any) -> str:
    return _env.get_template(template).render(num=num, chart=chart, show=show, **context)
