"""Bounded reads and keep-the-newest retention (isbflow.local.files) on real files."""

from __future__ import annotations

import os

from isbflow.local.files import keep_newest, rotate_log, tail


def test_tail_reads_only_the_end_of_a_big_log(tmp_path):
    log = tmp_path / "big.log"
    with open(log, "w") as f:
        for i in range(200_000):  # ~2.5 MB
            f.write(f"line {i}\n")
    assert tail(log, 3) == "line 199997\nline 199998\nline 199999"
    short = tail(log, 10_000, max_bytes=100)
    assert len(short) <= 100 and short.endswith("line 199999")
    assert tail(tmp_path / "none.log") == ""


def test_keep_newest_removes_the_oldest_files_and_folders(tmp_path):
    paths = []
    for i in range(8):
        p = tmp_path / (f"d{i}" if i % 2 else f"f{i}")
        if i % 2:
            (p / "inner").mkdir(parents=True)
        else:
            p.write_text("x")
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
        paths.append(p)
    removed = keep_newest([*paths, tmp_path / "gone"], 3)
    assert sorted(p.name for p in removed) == ["d1", "d3", "f0", "f2", "f4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d5", "d7", "f6"]
    assert keep_newest(tmp_path.iterdir(), 3) == []


def test_rotate_log_copies_then_truncates_and_an_appending_writer_goes_on_at_the_start(tmp_path):
    log = tmp_path / "driver.log"
    with open(log, "ab", buffering=0) as writer:  # how a launch opens a driver's stdout and stderr
        writer.write(b"a" * 3000)
        assert not rotate_log(log, 5000) and not (tmp_path / "driver.log.1").exists()
        assert rotate_log(log, 1000)
        assert (tmp_path / "driver.log.1").read_bytes() == b"a" * 3000 and log.stat().st_size == 0
        writer.write(b"next\n")
    assert log.read_bytes() == b"next\n"  # at the new end: no hole where the old bytes were
    assert not rotate_log(tmp_path / "none.log", 0)
