"""The Pipelines page's tuning panel (isbflow.airflow.ui.collect, pipelines.html) from the same report
as ``isbflow pipeline advise``, on a real nats-server (no Airflow process: the view and its HTML)."""

from __future__ import annotations

import asyncio
import time

from isbflow.airflow.ui import render as render_mod
from isbflow.airflow.ui.collect import read_status, static_view
from isbflow.airflow.ui.models import PipelinesResponse
from isbflow.airflow.ui.render import render
from isbflow.isb.connect import connect
from tests.ops.test_advise import filled  # noqa: F401 - the fixture


def test_the_pipelines_page_shows_desired_replicas_and_the_hot_partition(nats_server, filled):  # noqa: F811
    spec_file, p = filled

    async def go():
        view = static_view(spec_file.name, p)
        nc = await connect(nats_server.settings)
        try:
            await read_status(nc, view, p, stale_after=30.0)
        finally:
            await nc.close()
        return view

    view = asyncio.run(go())
    assert view.advice_error is None
    assert {a.vertex: a.desired_replicas for a in view.advice}["in"] == 3
    assert [(h.to_vertex, h.partition) for h in view.hot_partitions] == [("skewed", 0)]
    data = PipelinesResponse(pipelines_dir="x", generated_at=time.time(), stale_after_s=30.0, pipelines=[view])
    html = render("pipelines.html", base="/isbflow", nonce="n", page="pipelines", data=data, chart_w=render_mod.CHART_W,
                  chart_h=render_mod.CHART_H, chart_pad=render_mod.CHART_PAD, window_s=render_mod.WINDOW_S, refresh_ms=5000)
    assert 'data-hot="in-skewed-0"' in html and 'data-advice-step="in"' in html and 'data-desired="3"' in html
    assert "in-even" not in html.split("<h3>Tuning</h3>")[1].split("<h3>")[0]
