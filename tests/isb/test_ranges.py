"""``id_ranges`` (isbflow.isb.ranges): the ranges of source sequences in ``_isb_id`` values, on its
fast path (every id of one partition) and its general one, against a plain reference."""

from __future__ import annotations

import re

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from isbflow.isb.ranges import id_ranges

_ID = re.compile(r"^(.+/\d+)/(\d+)$")


def reference(ids: list[str | None]) -> dict[str, list[list[int]]]:
    seqs: dict[str, set[int]] = {}
    for i in ids:
        m = _ID.match(i) if i is not None else None
        if m and m.group(2).isascii():
            seqs.setdefault(m.group(1), set()).add(int(m.group(2)))
    out = {}
    for part, s in sorted(seqs.items()):
        ranges: list[list[int]] = []
        for q in sorted(s):
            if ranges and q == ranges[-1][1] + 1:
                ranges[-1][1] = q
            else:
                ranges.append([q, q])
        out[part] = ranges
    return out


seq = st.integers(min_value=0, max_value=10**12)
good = st.builds(lambda p, q: f"{p}/{q}", st.sampled_from(["in/0", "in/1", "src.x/12"]), seq)
junk = st.sampled_from([None, "", "in/0/", "in/0/x", "in/0/3/4", "in", "0/7", "in/a/5"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(good, good, junk), min_size=1, max_size=60))
def test_id_ranges_are_the_reference_on_any_ids(ids):
    assert id_ranges(pa.array(ids, pa.string())) == reference(ids)


@settings(max_examples=200, deadline=None)
@given(st.lists(seq, min_size=1, max_size=200))
def test_one_partition_ids_take_the_fast_path_to_the_same_ranges(seqs):
    ids = [f"in/3/{q}" for q in seqs]
    assert id_ranges(pa.chunked_array([pa.array(ids[:5]), pa.array(ids[5:], pa.string())])) == reference(ids)


def test_an_empty_column_has_no_ranges():
    assert id_ranges(pa.array([], pa.string())) == {}


def test_a_files_sources_ids_are_read_with_their_own_partition_pattern():
    ids = pa.array(["files/0001.jsonl/1", "files/0001.jsonl/2", "files/0002.jsonl/7", "in/0/3", None], pa.string())
    assert id_ranges(ids) == {"in/0": [[3, 3]]}  # a stream's ids only, by default
    landed = re.compile(r"^files/[^/]+$")
    assert id_ranges(ids, partition=landed) == {"files/0001.jsonl": [[1, 2]], "files/0002.jsonl": [[7, 7]]}
    assert id_ranges(ids[:2], partition=landed) == {"files/0001.jsonl": [[1, 2]]}  # the one-partition path
