"""The isb-files source with a real SparkSession: capped availableNow batches, exact ids, replay."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from isbflow.connector.files import (
    LANDING_DIRS_ENV,
    FilesSourceError,
    FilesStreamReader,
    Position,
    land,
    landed_lines,
    landing_folder,
    read_segment,
)
from isbflow.connector.files import (
    FileSegment as Seg,
)
from isbflow.ops import produce as P


def _lines(seed: int, start: int, count: int) -> list[bytes]:
    return [b for _, b in P.iter_payloads(seed, start, count)]


def _expected_ids(files: dict[str, int]) -> list[str]:
    return [f"files/{name}/{n}" for name in sorted(files) for n in range(1, files[name] + 1)]


def _run_available_now(spark, folder: Path, checkpoint: Path, max_rows: int) -> list[list[dict]]:
    """Run the query to completion; the rows of each micro-batch, in batch order."""
    batches: dict[int, list[dict]] = {}

    def collect(df, batch_id):
        batches[batch_id] = [r.asDict() for r in df.collect()]

    q = (spark.readStream.format("isb-files").option("path", str(folder))
         .option("readMaxRows", str(max_rows)).option("rowsPerPartition", "40").load()
         .writeStream.foreachBatch(collect).option("checkpointLocation", str(checkpoint))
         .trigger(availableNow=True).start())
    q.awaitTermination(300)
    assert q.exception() is None
    return [batches[b] for b in sorted(batches)]


def _offset_log(checkpoint: Path, batch: int) -> dict:
    return json.loads((checkpoint / "offsets" / str(batch)).read_text().splitlines()[-1])


def test_available_now_reads_every_line_once_in_capped_batches(spark, tmp_path):
    folder, checkpoint = tmp_path / "landing", tmp_path / "ckpt"
    land(folder, "0001-a.jsonl", _lines(1, 0, 150))
    land(folder, "0002-b.jsonl", _lines(1, 150, 100))
    land(folder, "0003-c.jsonl", [])  # an empty file is fine
    (folder / "0004-d.jsonl").write_bytes(b'{"x":1}\n\n{"x":2}')  # blank line; no final newline
    (folder / "0005-e.jsonl.tmp").write_bytes(b'{"partial":')  # still being written: never read
    (folder / "notes.txt").write_text("not a landing file\n")

    batches = _run_available_now(spark, folder, checkpoint, max_rows=120)
    assert [len(b) for b in batches] == [120, 120, 13]
    rows = [r for b in batches for r in b]
    ids = [r["_isb_id"] for r in rows]
    assert sorted(ids) == sorted(_expected_ids({"0001-a.jsonl": 150, "0002-b.jsonl": 100, "0004-d.jsonl": 3}))
    assert len(set(ids)) == len(ids)
    by_id = {r["_isb_id"]: r["value"] for r in rows}
    assert by_id["files/0001-a.jsonl/1"] == _lines(1, 0, 1)[0].decode()
    assert by_id["files/0002-b.jsonl/100"] == _lines(1, 249, 1)[0].decode()
    assert (by_id["files/0004-d.jsonl/2"], by_id["files/0004-d.jsonl/3"]) == ("", '{"x":2}')

    # re-reading batch 1's offset range outside Spark gives exactly what Spark saw
    reader = FilesStreamReader(str(folder), "*.jsonl", 120, 40)
    start, end = _offset_log(checkpoint, 0), _offset_log(checkpoint, 1)
    assert end == {"file": "0002-b.jsonl", "line": 90}
    again = [row for p in reader.partitions(start, end) for b in reader.read(p) for row in b.to_pylist()]
    assert sorted(again, key=lambda r: r["_isb_id"]) == sorted(batches[1], key=lambda r: r["_isb_id"])
    assert again == [row for p in reader.partitions(start, end) for b in reader.read(p) for row in b.to_pylist()]

    # a new file landing between runs is picked up by the next run, and only it
    land(folder, "0006-f.jsonl", _lines(2, 0, 30))
    (folder / "0005-e.jsonl.tmp").unlink()
    more = _run_available_now(spark, folder, checkpoint, max_rows=120)
    assert [r["_isb_id"] for b in more for r in b] == _expected_ids({"0006-f.jsonl": 30})
    # nothing new: a third run reads nothing
    assert sum(len(b) for b in _run_available_now(spark, folder, checkpoint, max_rows=120)) == 0


def test_latest_offset_respects_the_limit_and_the_available_now_target(tmp_path):
    land(tmp_path, "a.jsonl", ["{}"] * 5)
    land(tmp_path, "b.jsonl", ["{}"] * 5)

    r = FilesStreamReader(str(tmp_path), "*.jsonl", 100, 100)
    start = r.initialOffset()
    assert r.latestOffset(start, ReadMaxRows(7)) == {"file": "b.jsonl", "line": 2}
    assert r.latestOffset({"file": "a.jsonl", "line": 5}, ReadMaxRows(3)) == {"file": "b.jsonl", "line": 3}
    r.prepareForTriggerAvailableNow()
    land(tmp_path, "c.jsonl", ["{}"] * 5)  # after the target: not part of this run
    assert r.latestOffset(start, ReadAllAvailable()) == {"file": "b.jsonl", "line": 5}
    end = {"file": "b.jsonl", "line": 5}
    assert r.latestOffset(end, ReadAllAvailable()) == end
    assert [(p.name, p.lo, p.hi) for p in r.partitions({"file": "a.jsonl", "line": 3}, end)] == [
        ("a.jsonl", 3, 5), ("b.jsonl", 0, 5)]


def test_a_landed_file_that_changes_or_vanishes_is_an_error(tmp_path):
    f = land(tmp_path, "a.jsonl", ["{}"] * 5)
    f.write_text("{}\n")
    with pytest.raises(FilesSourceError, match="must not change"):
        list(FilesStreamReader.read(None, Seg(str(tmp_path), "a.jsonl", 0, 5)))  # type: ignore[arg-type]
    f.unlink()
    with pytest.raises(FilesSourceError, match="is gone"):
        list(FilesStreamReader.read(None, Seg(str(tmp_path), "a.jsonl", 0, 5)))  # type: ignore[arg-type]
    with pytest.raises(FilesSourceError, match="not an offset"):
        Position.from_json({"seq": 3})


def _read_all(folder: Path, **kw) -> list[dict]:
    """Every row the source reads from ``folder`` from the start, as the driver and tasks would."""
    r = FilesStreamReader(str(folder), "*.jsonl", 1000, 1000, **kw)
    end = r.latestOffset(r.initialOffset(), ReadAllAvailable())
    return [row for p in r.partitions(r.initialOffset(), end) for b in r.read(p) for row in b.to_pylist()]


def test_a_symlinked_landing_file_is_never_read(tmp_path):
    secret = tmp_path / "owner-only"
    secret.write_text('{"secret":"s3cr3t"}\n')
    secret.chmod(0o600)
    folder = tmp_path / "landing"
    land(folder, "0001-a.jsonl", ['{"x":1}'])
    (folder / "0002-link.jsonl").symlink_to(secret)
    rows = _read_all(folder)
    assert [r["_isb_id"] for r in rows] == ["files/0001-a.jsonl/1"]
    assert all("s3cr3t" not in (r["value"] or "") for r in rows)
    # a landed name swapped for a symlink after it was listed fails the task, it never reads the target
    with pytest.raises(FilesSourceError, match="is a symlink"):
        list(read_segment(Seg(str(folder), "0002-link.jsonl", 0, 1)))

    # what recovery checks the sinks against: the landed files' lines, never the link's target
    (folder / "0003-b.jsonl.tmp").write_text('{"x":2}\n')
    assert landed_lines(folder, "*.jsonl") == {"files/0001-a.jsonl": 1}


def test_a_fifo_in_the_landing_folder_never_blocks_the_source(tmp_path):
    folder = tmp_path / "landing"
    land(folder, "0001-a.jsonl", ['{"x":1}'])
    fifo = folder / "0002-pipe.jsonl"
    os.mkfifo(fifo)
    out: list = []
    t = threading.Thread(target=lambda: out.append(_read_all(folder)), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # blocked opening the FIFO: release it, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("the files source blocked on a FIFO")
    assert [r["_isb_id"] for r in out[0]] == ["files/0001-a.jsonl/1"]
    with pytest.raises(FilesSourceError, match="a FIFO, not a regular file"):
        list(read_segment(Seg(str(folder), "0002-pipe.jsonl", 0, 1)))


def test_a_non_utf8_line_is_dead_lettered_with_its_reason_and_the_rest_is_read(tmp_path):
    folder = tmp_path / "landing"
    (folder).mkdir()
    (folder / "0001-a.jsonl").write_bytes(b'{"x":1}\n{"x":"caf\xe9"}\n{"x":3}\n')
    rows = _read_all(folder)
    assert [r["_isb_id"] for r in rows] == [f"files/0001-a.jsonl/{n}" for n in (1, 2, 3)]
    assert [r["_isb_error"] for r in rows[::2]] == [None, None]
    assert rows[1]["value"] == '{"x":"caf\\xe9"}'
    assert "line 2 of landed file 0001-a.jsonl is not UTF-8 (byte 0xe9 at offset 9)" in rows[1]["_isb_error"]


def test_an_over_long_line_is_dead_lettered_without_being_read_whole(tmp_path):
    folder = tmp_path / "landing"
    land(folder, "0001-a.jsonl", ['{"x":1}', '{"x":"' + "y" * 5000 + '"}', '{"x":3}', "z" * 64])
    rows = _read_all(folder, max_line_bytes=64)
    assert [r["_isb_id"] for r in rows] == [f"files/0001-a.jsonl/{n}" for n in (1, 2, 3, 4)]
    assert [rows[i]["_isb_error"] for i in (0, 2, 3)] == [None, None, None]  # 64 bytes: not over
    assert "line 2 of landed file 0001-a.jsonl is 5008 bytes, over the files source's maxLineBytes (64)" \
        in rows[1]["_isb_error"]
    assert rows[1]["value"] == '{"x":"' + "y" * 58  # its first bytes (up to 1 KiB), for the dead letter
    # the file is read a buffer at a time: a line's bytes past the limit are never held
    segs = list(read_segment(Seg(str(folder), "0001-a.jsonl", 1, 3, max_line_bytes=64)))
    assert [r["_isb_id"] for b in segs for r in b.to_pylist()] == ["files/0001-a.jsonl/2", "files/0001-a.jsonl/3"]


def test_a_spec_reads_landing_folders_only_under_the_data_dir_or_the_configured_ones(tmp_path, monkeypatch):
    data = tmp_path / "data"
    (data / "landing").mkdir(parents=True)
    monkeypatch.delenv(LANDING_DIRS_ENV, raising=False)
    assert landing_folder("landing", data) == data / "landing"
    assert landing_folder(str(data / "landing"), data) == data / "landing"
    with pytest.raises(FilesSourceError, match=r"source.files.path '/root/.ssh' is outside the folders"):
        landing_folder("/root/.ssh", data)
    (data / "escape").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FilesSourceError, match="ISBFLOW_LANDING_DIRS"):
        landing_folder("escape", data)  # a symlink out of the data dir
    monkeypatch.setenv(LANDING_DIRS_ENV, str(tmp_path / "elsewhere"))
    assert landing_folder("escape", data) == data / "escape"
    assert landing_folder(str(tmp_path / "elsewhere" / "in"), data) == tmp_path / "elsewhere" / "in"
