"""What the reading side of a frame refuses (:func:`isbflow.isb.frames.read_frame`), exploit by exploit,
and that every frame a writer makes still reads."""

from __future__ import annotations

import pyarrow as pa
import pytest

from isbflow.isb import frames
from tests.helpers.crafted_frames import null_column_bomb, short_buffers


def test_a_null_column_claiming_200_million_records_is_refused_before_anything_is_allocated():
    bomb = null_column_bomb(200_000_000)
    assert len(bomb) == 224
    with pytest.raises(frames.BadFrame, match=r"column 'id' \(null\) is null-typed: such a column needs no bytes"):
        frames.read_frame(bomb, "200000000")


def test_a_frame_whose_buffers_are_shorter_than_its_row_count_is_refused():
    lying = short_buffers(claim=1000)  # under the cap of records per byte: validation catches it
    with pytest.raises(frames.BadFrame, match=r"does not hold the 1000 records it declares .*Buffer #1 too small"):
        frames.read_frame(lying, "1000")
    with pytest.raises(frames.BadFrame, match="does not hold"):
        frames.decode(lying)
    with pytest.raises(frames.BadFrame, match=r"claims 100000000 records, over the cap"):
        frames.read_frame(short_buffers(claim=100_000_000))


@pytest.mark.parametrize("column", [
    pa.array([[None]] * 3, pa.list_(pa.null())),  # nested: the child claims any length
    pa.array([{}] * 3, pa.struct([])),
    pa.array([{"a": None}] * 3, pa.struct([pa.field("a", pa.null())])),
    pa.RunEndEncodedArray.from_arrays([3], pa.array([1], pa.int64())),
    pa.array([b""] * 3, pa.binary(0)),
    pa.array([[]] * 3, pa.list_(pa.int8(), 0)),
    pa.DictionaryArray.from_arrays(pa.array([0, 0, 0], pa.int8()), pa.nulls(1)),
], ids=["list-of-null", "empty-struct", "struct-of-null", "run-end-encoded", "zero-width-binary",
        "empty-fixed-list", "dictionary-of-null"])
def test_columns_that_need_no_bytes_per_record_are_refused_at_any_depth_and_never_written(column):
    payload = frames.encode(pa.RecordBatch.from_arrays([pa.array([1, 2, 3]), column], names=["id", "x"]))
    with pytest.raises(frames.BadFrame, match=r"its column 'x' .* such a column needs no bytes per record"):
        frames.read_frame(payload)
    # the writing side refuses the batch, naming the column, instead of making frames no step would read
    with pytest.raises(ValueError, match=r"column 'x' .* give it a type"):
        frames.split_frames(pa.table({"id": [1, 2, 3], "x": column}), 1 << 20)


def test_a_frame_without_columns_may_claim_at_most_eight_records_a_byte():
    def no_columns(rows: int) -> bytes:
        return frames.encode(pa.RecordBatch.from_struct_array(pa.array([{}] * rows, pa.struct([]))))

    assert sum(b.num_rows for b in frames.read_frame(no_columns(1000), "1000")) == 1000
    bomb = no_columns(10_000)
    with pytest.raises(frames.BadFrame, match=rf"the frame of {len(bomb)} bytes claims 10000 records, over the cap "
                                              rf"of {8 * len(bomb)} \(8 per byte"):
        frames.read_frame(bomb)


def test_the_densest_frames_a_writer_makes_still_read():
    """A record takes at least a bit: a boolean column without nulls, or an all-null column of any
    type (validity bitmap and values), is what a frame honestly packs densest."""
    for table in (pa.table({"b": pa.array([True, False] * 50_000)}),
                  pa.table({"n": pa.nulls(100_000, pa.int64()), "s": pa.nulls(100_000, pa.string())}),
                  pa.table({"s": pa.array([""] * 100_000)}),
                  pa.table({"l": pa.array([[]] * 100_000, pa.list_(pa.bool_()))})):
        split = frames.split_frames(table, 8 << 20, max_rows=100_000)
        assert [f.rows for f in split.frames] == [100_000]
        payload = split.frames[0].payload
        got = frames.read_frame(payload, "100000")
        assert pa.Table.from_batches(got).equals(table)
        assert frames.decode(payload).equals(table)
