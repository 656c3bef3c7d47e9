"""What reprocess reads from the buffers (:mod:`isbflow.recovery.reprocess_read`) on a real nats-server:
frames it cannot trust are read through the same checks as a step's."""

from __future__ import annotations

import asyncio
import logging

import pyarrow as pa
import pytest

from isbflow.isb import frames, ledger, naming, provision
from isbflow.isb.connect import connect
from isbflow.recovery.reprocess_plan import ReprocessError
from isbflow.recovery.reprocess_read import check_in_flight
from isbflow.spec import load_specs
from tests.conftest import ROOT
from tests.helpers.crafted_frames import null_column_bomb

SPEC = ROOT / "tests" / "specs" / "reprocess-logs.yaml"


def test_the_in_flight_check_passes_over_crafted_frames_and_counts_the_readable_ones(nats_server, caplog):
    settings = nats_server.settings
    specs = load_specs(SPEC)
    p = specs.only_pipeline()
    asyncio.run(provision.apply(settings, specs))
    edge = next(ep for ep in naming.edge_partitions(p) if ep.from_vertex == "in" and ep.partition == 0)
    ids = pa.table({ledger.ID_COLUMN: ["in/0/5", "in/0/6", "in/0/7", "in/0/500"]})

    async def go():
        nc = await connect(settings)
        try:
            js = nc.jetstream()
            for payload, rows in ((b"\x00not an arrow frame" * 20, "20"),  # seq 1
                                  (null_column_bomb(1_000_000, (ledger.ID_COLUMN,)), "1000000"),  # seq 2
                                  (frames.encode(ids), "4")):  # seq 3: three ids of the range
                await js.publish(edge.subject, payload, headers={frames.HDR_FRAME: frames.FRAME_FORMAT,
                                                                 frames.HDR_ROWS: rows})
            await check_in_flight(nc, p, {"in"}, {"in/0": [[1, 100]]})
        finally:
            await nc.close()

    with caplog.at_level(logging.WARNING, logger="isbflow.recovery.reprocess_read"), \
            pytest.raises(ReprocessError, match=rf"3 record\(s\) of the range are still in flight in buffer {edge.stream}"):
        asyncio.run(go())
    passed_over = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
    assert len(passed_over) == 2, caplog.text
    assert passed_over[0].startswith(f"frame 1 of buffer {edge.stream} cannot be read: not an Arrow IPC frame")
    assert passed_over[1].startswith(f"frame 2 of buffer {edge.stream} cannot be read: its column "
                                     f"'{ledger.ID_COLUMN}' (null) is null-typed")
    assert all("tag dead-letters it" in m for m in passed_over)
