"""Events batches (isbflow.connector.batches): cut by rows or payload bytes, whichever first."""

from __future__ import annotations

from isbflow.connector.batches import EVENTS_SCHEMA, arrow_schema, events_batches


def test_events_batches_are_cut_by_rows_or_bytes_whichever_first():
    target = arrow_schema(EVENTS_SCHEMA)
    big = [(i, b"x" * 1000, {}, 10**18 + i) for i in range(1, 11)]
    by_bytes = list(events_batches(big, "s", "p/0/", target, max_rows=100, max_bytes=3000))
    assert [b.num_rows for b in by_bytes] == [3, 3, 3, 1]
    by_rows = list(events_batches(big, "s", "p/0/", target, max_rows=4, max_bytes=1 << 30))
    assert [b.num_rows for b in by_rows] == [4, 4, 2]
    # one event over the cap still travels, alone
    huge = [(1, b"y" * 5000, {}, 10**18), (2, b"z", {}, 10**18)]
    assert [b.num_rows for b in events_batches(huge, "s", "p/0/", target, max_bytes=3000)] == [1, 1]
    assert sum(b.num_rows for b in by_bytes) == 10
    assert by_bytes[0].column(2).to_pylist() == [1, 2, 3]
