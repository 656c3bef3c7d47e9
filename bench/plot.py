"""Draw a benchmark's JSON series as an SVG line chart (no plotting library needed).

    python bench/plot.py bench/results/soak.json --out docs/images/soak.svg \
        [--metric cpu_per_batch_s --metric rss_bytes ...] [--title "..."]

For ``bench/soak.py``'s JSON: each metric is drawn against minutes since the measured run began,
one small chart per metric, stacked. Counter pairs (``cpu_per_batch_s``: CPU seconds over
committed batches; ``commit_latency_s``: Spark's batch time over batches) are drawn as their
rate between consecutive samples, smoothed over a window of ``--smooth`` samples; every other
metric is drawn as sampled. The dashed lines mark the first and the last fifth the slopes
compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from html import escape
from pathlib import Path

RATIOS = {"cpu_per_batch_s": ("cpu_s", "batches_total"), "commit_latency_s": ("batch_sum_s", "batch_count")}
DEFAULT_METRICS = ["cpu_per_batch_s", "commit_latency_s", "rss_bytes", "delta_log_bytes", "checkpoint_bytes",
                   "ledger_bytes"]
UNITS = {"_bytes": (1 / 2**20, "MiB"), "_s": (1.0, "s")}
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 640, 150, 70, 20, 28, 30


def rates(series: list[dict], num: str, den: str, smooth: int) -> list[tuple[float, float]]:
    """(t, growth of ``num`` over growth of ``den``) over windows of ``smooth`` samples."""
    out = []
    for i in range(smooth, len(series)):
        a, b = series[i - smooth], series[i]
        d = b.get(den, 0) - a.get(den, 0)
        if d > 0:
            out.append((b["t"], (b.get(num, 0) - a.get(num, 0)) / d))
    return out


def points(series: list[dict], metric: str, smooth: int) -> list[tuple[float, float]]:
    if metric in RATIOS:
        return rates(series, *RATIOS[metric], smooth)
    return [(s["t"], float(s[metric])) for s in series if s.get(metric) is not None]


def unit(metric: str) -> tuple[float, str]:
    return next((u for suffix, u in UNITS.items() if metric.endswith(suffix)), (1.0, ""))


def chart(metric: str, pts: list[tuple[float, float]], t0: float, t1: float, y0: int) -> str:
    """One chart's SVG elements, its top at ``y0``."""
    scale, label = unit(metric)
    if not pts:
        return f'<text x="{PAD_L}" y="{y0 + PAD_T + 20}">{escape(metric)}: no samples</text>'
    ys = [v * scale for _, v in pts]
    lo, hi = 0.0, max(ys) * 1.1 or 1.0
    span = (t1 - t0) or 1.0

    def x(t: float) -> float:
        return PAD_L + (t - t0) / span * (W - PAD_L - PAD_R)

    def y(v: float) -> float:
        return y0 + PAD_T + (1 - (v - lo) / (hi - lo)) * (H - PAD_T - PAD_B)

    line = " ".join(f"{x(t):.1f},{y(v * scale):.1f}" for t, v in pts)
    fifth = span / 5
    marks = "".join(f'<line x1="{x(t):.1f}" y1="{y0 + PAD_T}" x2="{x(t):.1f}" y2="{y0 + H - PAD_B}" '
                    f'stroke="#999" stroke-dasharray="4 3"/>' for t in (t0 + fifth, t1 - fifth))
    axis = (f'<line x1="{PAD_L}" y1="{y0 + H - PAD_B}" x2="{W - PAD_R}" y2="{y0 + H - PAD_B}" stroke="#333"/>'
            f'<line x1="{PAD_L}" y1="{y0 + PAD_T}" x2="{PAD_L}" y2="{y0 + H - PAD_B}" stroke="#333"/>')
    ticks = "".join(f'<text x="{PAD_L - 6}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="10">{v:.3g}</text>'
                    for v in (lo, hi / 2, hi))
    minutes = "".join(f'<text x="{x(t0 + f * span):.1f}" y="{y0 + H - PAD_B + 14}" text-anchor="middle" '
                      f'font-size="10">{f * span / 60:.0f} min</text>' for f in (0, 0.25, 0.5, 0.75, 1))
    title = f'<text x="{PAD_L}" y="{y0 + 16}" font-size="12" font-weight="bold">{escape(metric)}' \
            f'{f" ({label})" if label else ""}</text>'
    return (title + axis + ticks + minutes + marks
            + f'<polyline fill="none" stroke="#3f51b5" stroke-width="1.5" points="{line}"/>')


def render(result: dict, metrics: list[str], title: str, smooth: int) -> str:
    series = result["series"]
    run = result.get("run", {})
    steady_from = float(run.get("steady_from_s", series[0]["t"]))
    t1 = steady_from + float(run.get("steady_seconds", series[-1]["t"] - steady_from))
    t0 = float(run.get("measured_from_s", steady_from))  # after --settle-minutes
    steady = [s for s in series if t0 <= s["t"] <= t1]
    height = 30 + H * len(metrics)
    body = "".join(chart(m, points(steady, m, smooth), t0, t1, 30 + i * H) for i, m in enumerate(metrics))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" '
            f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>'
            f'<text x="10" y="20" font-size="14">{escape(title)}</text>{body}</svg>\n')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a benchmark's JSON (with 'series')")
    ap.add_argument("--out", required=True, help="the SVG file to write")
    ap.add_argument("--metric", action="append", help=f"a metric to draw (default: {', '.join(DEFAULT_METRICS)})")
    ap.add_argument("--title", default="", help="the chart's title")
    ap.add_argument("--smooth", type=int, default=6, help="samples per rate window (default 6)")
    args = ap.parse_args(argv)
    result = json.loads(Path(args.json).read_text())
    if not result.get("series"):
        print(f"{args.json}: no 'series' to draw", file=sys.stderr)
        return 2
    metrics = args.metric or [m for m in DEFAULT_METRICS if m in RATIOS or m in result["series"][-1]]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(render(result, metrics, args.title or Path(args.json).name, args.smooth))
    print(f"wrote {args.out} ({len(metrics)} charts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
