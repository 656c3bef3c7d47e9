"""Local hygiene: a private data dir, no kill in the Spark UI, a strict Data Docs CSP, no printed
password, reference loads that time out and validate their rows.

NATS parts run against the real nats-server of the ``nats_server`` fixture, Spark parts in the
suite's SparkSession, the CSP in Debian's Chromium (``/usr/bin/chromium``, as tests/e2e/test_browser.py).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import stat
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from isbflow.cli import app
from isbflow.connector.writer import JetStreamStreamWriter, JetStreamWriteReport, WriterOptions
from isbflow.isb import naming
from isbflow.isb import reference as R
from isbflow.isb.connect import NatsSettings, connect, settings_to_json
from isbflow.spec.paths import DataDir, private_dir

CHROMIUM = "/usr/bin/chromium"


def wider_than_owner(root: Path) -> list[str]:
    """Every folder under ``root`` (itself included) that its group or others may enter or read."""
    out = []
    for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        mode = stat.S_IMODE(d.stat().st_mode)
        if mode & 0o077:
            out.append(f"{d.relative_to(root.parent)} {oct(mode)}")
    return out


@pytest.fixture
def open_umask():
    """The usual umask 022 while the test runs: folders would come out 0755 without isbflow's care."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# ----------------------------------------------------------------------------- the data dir is 0700


def test_data_dir_and_its_folders_are_created_private(tmp_path, open_umask):
    dd = DataDir(tmp_path / "a" / "data")
    assert dd.ensure() == dd.root
    assert stat.S_IMODE(dd.root.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700  # created on the way: private too
    dd.make(dd.logs / "deep" / "er")
    stats = dd.stats("p", "parse", "agg")
    writer = JetStreamStreamWriter(WriterOptions(settings=NatsSettings(servers=("nats://127.0.0.1:1",)),
                                                 pipeline="p", step="parse", to="agg", stats_dir=str(stats)))
    writer.commit([JetStreamWriteReport(0, 0)], 0)
    assert (stats / "totals.json").exists()
    assert wider_than_owner(dd.root) == []

    # an existing data dir open to others is closed (the owner's bits stay)
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    DataDir(old).ensure()
    assert stat.S_IMODE(old.stat().st_mode) == 0o700
    # private_dir leaves existing folders as they are and creates the missing ones 0700
    private_dir(tmp_path / "old" / "x")
    assert stat.S_IMODE((tmp_path / "old" / "x").stat().st_mode) == 0o700


def test_embedded_server_data_dir_is_private(nats_server):
    dd = nats_server.data_dir
    assert (dd / "nats" / "n1" / "jetstream").is_dir()
    assert wider_than_owner(dd) == []


def test_spark_checkpoints_are_private_and_the_ui_cannot_kill(spark, tmp_path, open_umask):
    assert spark.sparkContext.getConf().get("spark.ui.killEnabled") == "false"
    assert spark.conf.get("spark.ui.killEnabled") == "false"

    dd = DataDir(tmp_path / "data")
    dd.ensure()
    q = (spark.readStream.format("isb-memory").option("rows", "100").load()
         .writeStream.format("noop").option("checkpointLocation", str(dd.checkpoint("p", "parse", "agg")))
         .trigger(availableNow=True).start())
    assert q.awaitTermination(120) and q.exception() is None
    assert (dd.checkpoint("p", "parse", "agg") / "commits").is_dir()
    assert wider_than_owner(dd.root) == []


def test_the_per_batch_falling_behind_warning_is_off_whatever_the_root_level(spark):
    from isbflow.steps.session import TRIGGER_LOGGERS

    jvm = spark.sparkContext._jvm
    jvm.java.lang.Class.forName(TRIGGER_LOGGERS[0])  # the logger is named for Spark's real class
    spark.sparkContext.setLogLevel("WARN")  # what a launched driver sets
    try:
        assert str(jvm.org.apache.logging.log4j.LogManager.getLogger(TRIGGER_LOGGERS[0]).getLevel()) == "ERROR"
        assert str(jvm.org.apache.logging.log4j.LogManager.getRootLogger().getLevel()) == "WARN"
    finally:
        spark.sparkContext.setLogLevel("ERROR")  # the suite's


# ----------------------------------------------------------------------------- no command prints a password


def test_no_nats_command_prints_the_password(nats_server):
    dd = nats_server.data_dir
    password = (dd / "nats" / "password").read_text().strip()
    runner = CliRunner()
    port = nats_server.state.nodes[0].client_port
    for args in (["status"], ["status", "--json"], ["up"], ["up", "--json"]):
        r = runner.invoke(app, ["nats", *args, "--data-dir", str(dd)])
        assert r.exit_code == 0, r.output
        assert password not in r.output, args
        if "--json" in args:
            shown = json.loads(r.output)
            assert shown["urls"] == [f"nats://127.0.0.1:{port}"]
            assert Path(shown["password_file"]) == (dd / "nats" / "password").absolute()
            assert shown["user"] == "isbflow"
        else:
            assert f"NATS_URL=nats://127.0.0.1:{port}" in r.output
            assert f"password in {(dd / 'nats' / 'password').absolute()}" in r.output


# ----------------------------------------------------------------------------- the Data Docs CSP


def test_report_csp_is_sandboxed_without_forms_or_base():
    from isbflow.airflow.ui.app import REPORT_CSP

    directives = {d.strip().split()[0]: d.strip().split()[1:] for d in REPORT_CSP.split(";") if d.strip()}
    assert directives["script-src"] == ["'none'"]
    assert directives["form-action"] == ["'none'"]
    assert directives["base-uri"] == ["'none'"]
    assert "sandbox" in directives
    assert not any(flag.startswith("allow-") and flag != "allow-same-origin" for flag in directives["sandbox"])


def test_report_csp_in_chromium_blocks_scripts_and_forms_and_keeps_styles(tmp_path):
    """A report page served with REPORT_CSP behind a SameSite=Lax session cookie (as Airflow's
    ``_token``): its stylesheet and image load, its script does not run, its form does not post."""
    from playwright.sync_api import sync_playwright

    from isbflow.airflow.ui.app import REPORT_CSP

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    seen: list[tuple[str, bool]] = []
    page_html = (b'<html><head><link rel="stylesheet" href="/r/s.css"><base href="http://example.invalid/">'
                 b'</head><body><p id="x">report</p><img id="i" src="/r/i.svg">'
                 b'<script>document.title = "script ran"</script>'
                 b'<form id="f" method="post" action="/r/post"><button id="b">go</button></form></body></html>')
    bodies = {"/r/page.html": ("text/html", page_html),
              "/r/s.css": ("text/css", b"#x { color: rgb(255, 0, 0); }"),
              "/r/i.svg": ("image/svg+xml", b'<svg xmlns="http://www.w3.org/2000/svg" width="7" height="7"/>')}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self) -> None:
            authed = "_token=t" in (self.headers.get("Cookie") or "")
            seen.append((f"{self.command} {self.path}", authed))
            if self.path == "/login":
                self.send_response(200)
                self.send_header("Set-Cookie", "_token=t; Path=/; SameSite=Lax; HttpOnly")
                self.end_headers()
                return
            if not authed or self.path not in bodies:
                self.send_response(401 if not authed else 404)
                self.end_headers()
                return
            media, body = bodies[self.path]
            self.send_response(200)
            self.send_header("Content-Type", media)
            self.send_header("Content-Security-Policy", REPORT_CSP)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page()
                page.goto(base + "/login")
                page.goto(base + "/r/page.html")
                page.wait_for_load_state("load")
                assert page.eval_on_selector("#x", "e => getComputedStyle(e).color") == "rgb(255, 0, 0)"
                assert page.eval_on_selector("#i", "e => e.naturalWidth") == 7
                assert page.title() != "script ran"
                page.click("#b", no_wait_after=True)
                time.sleep(1.0)
            finally:
                browser.close()
    finally:
        server.shutdown()
    assert ("GET /r/s.css", True) in seen and ("GET /r/i.svg", True) in seen
    assert not [r for r, _ in seen if r.startswith("POST") or "example.invalid" in r], seen


# ----------------------------------------------------------------------------- reference loads


def _kv_put_raw(settings, bucket: str, items: dict[str, bytes]) -> None:
    async def go():
        nc = await connect(settings)
        try:
            kv = await nc.jetstream().key_value(bucket)
            for k, v in items.items():
                await kv.put(k, v)
        finally:
            await nc.close()

    asyncio.run(go())


def test_reference_load_times_out_naming_the_bucket(nats_server, monkeypatch):
    settings = nats_server.settings
    asyncio.run(R.put(settings, "logs", "services", {"auth": {"team": "identity"}}))

    async def stalled(nc, bucket):  # a read that never ends (as a watcher can after a purge)
        await asyncio.sleep(3600)

    monkeypatch.setattr(R, "_entries", stalled)
    started = time.monotonic()
    bucket = naming.reference_bucket("logs", "services")
    with pytest.raises(R.ReferenceError, match=rf"loading reference table 'services' of pipeline logs "
                                               rf"\(KV bucket {bucket}\).*timed out after 1 s"):
        asyncio.run(R.load(settings, "logs", "services", timeout=1.0))
    assert time.monotonic() - started < 10


def test_reference_load_after_a_purge_or_a_removed_last_message_ends(nats_server):
    settings = nats_server.settings
    rows = {"auth": {"team": "identity", "tier": 1}, "users": {"team": "identity", "tier": 3}}
    asyncio.run(R.put(settings, "logs", "services", rows))
    stream = f"KV_{naming.reference_bucket('logs', 'services')}"

    async def remove_last():
        nc = await connect(settings)
        try:
            # the last key's message purged from the stream: the last sequence has no message, last_seq stays
            await nc.jsm().purge_stream(stream, subject=f"$KV.{naming.reference_bucket('logs', 'services')}.users")
        finally:
            await nc.close()

    asyncio.run(remove_last())
    _, table = asyncio.run(R.load(settings, "logs", "services", key="service", timeout=10))
    assert table.to_pylist() == [{"service": "auth", "team": "identity", "tier": 1}]

    async def purge():
        nc = await connect(settings)
        try:
            await nc.jsm().purge_stream(stream)
        finally:
            await nc.close()

    asyncio.run(purge())
    _, table = asyncio.run(R.load(settings, "logs", "services", key="service", timeout=10))
    assert table.num_rows == 0


@pytest.mark.parametrize(("raw", "message"), [
    (b"{oops", r"reference row 'bad' of KV bucket \S+ is not JSON"),
    (b"[1, 2]", r"reference row 'bad' of KV bucket \S+ must be an object of columns, got list"),
    (b'{"team": {"name": "x"}}', r"reference row 'bad' of KV bucket \S+: column 'team' must be a string, number, "
                                 r"boolean or null, got dict"),
    (b'{"team": 7}', r"reference row 'bad' of KV bucket \S+: column 'team' is a number, but a string in row 'auth'"),
])
def test_reference_load_rejects_a_bad_row_naming_its_key(nats_server, raw, message):
    settings = nats_server.settings
    asyncio.run(R.put(settings, "logs", "services", {"auth": {"team": "identity"}}))
    _kv_put_raw(settings, naming.reference_bucket("logs", "services"), {"bad": raw})
    with pytest.raises(R.ReferenceError, match=message):
        asyncio.run(R.load(settings, "logs", "services"))


def test_reference_put_rejects_a_bad_row_naming_its_key():
    with pytest.raises(R.ReferenceError, match=r"reference row 'a': column 'team' must be a string.*got list"):
        R.check_rows({"a": {"team": ["x"]}})
    with pytest.raises(R.ReferenceError, match=r"reference row 'b': column 'tier' is a string, but a number in row 'a'"):
        R.check_rows({"a": {"tier": 1}, "b": {"tier": "1"}})
    R.check_rows({"a": {"tier": 1, "x": None}, "b": {"tier": 2.5, "x": True}})  # int and float: one number column


def test_isb_ref_source_names_the_bad_row_and_checks_its_timeout(spark, nats_server):
    from isbflow.isb.errors import ConnectorOptionError

    settings = nats_server.settings
    asyncio.run(R.put(settings, "logs", "services", {"auth": {"team": "identity"}}))
    _kv_put_raw(settings, naming.reference_bucket("logs", "services"), {"bad": b"[1]"})

    def read(**options):
        r = (spark.read.format("isb-ref").option("pipeline", "logs").option("name", "services")
             .option("key", "service").option("settings", settings_to_json(settings)))
        for k, v in options.items():
            r = r.option(k, v)
        return r.load()

    with pytest.raises(Exception, match=r"reference row 'bad' of KV bucket \S+ must be an object"):
        read(timeout="5").collect()
    with pytest.raises(Exception, match=r"option 'timeout': expected seconds > 0, got 'soon'") as e:
        read(timeout="soon")
    assert "ConnectorOptionError" in str(e.value) or isinstance(e.value, ConnectorOptionError)


# ----------------------------------------------------------------------------- hostile frames

FRAME_SCHEMA = "id long, msg string"


def _rows(lo: int, hi: int):
    import pyarrow as pa

    return pa.table({"id": pa.array(range(lo, hi), pa.int64()), "msg": [f"m{i}" for i in range(lo, hi)]})


def _bomb() -> bytes:
    """A small LZ4-compressed frame whose first compressed buffer declares 10 GiB once decoded."""
    import struct

    import pyarrow as pa

    from isbflow.isb import frames

    sink = pa.BufferOutputStream()
    table = _rows(0, 5000)
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as w:
        w.write_table(table)
    payload = bytearray(sink.getvalue().to_pybytes())
    reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(bytes(payload)))
    reader.read_next_message()  # the schema
    message = reader.read_next_message()
    body, meta = message.body.to_pybytes(), message.metadata.to_pybytes()
    at_body = bytes(payload).rfind(body)
    batch = frames._Fb(meta, struct.unpack_from("<I", meta, 0)[0]).table(2)
    for at in batch.structs(2, 16):
        offset, length = struct.unpack_from("<qq", meta, at)
        if length >= 8 and struct.unpack_from("<q", body, offset)[0] != -1:
            struct.pack_into("<q", payload, at_body + offset, 10 << 30)
            return bytes(payload)
    raise AssertionError("no compressed buffer to forge")


def test_read_frame_refuses_garbage_bombs_and_lying_headers():
    from isbflow.isb import frames

    good = frames.encode(_rows(0, 10))
    assert sum(b.num_rows for b in frames.read_frame(good, "10")) == 10
    assert frames.decoded_size(good) <= len(good)
    with pytest.raises(frames.BadFrame, match="not an Arrow IPC frame"):
        frames.read_frame(b"\x00garbage" * 50)
    with pytest.raises(frames.BadFrame, match=r"declares 10737\d+ bytes once decoded, over the cap"):
        frames.read_frame(_bomb())
    with pytest.raises(frames.BadFrame, match="Isb-Rows header 'ten' is not a row count"):
        frames.read_frame(good, "ten")
    with pytest.raises(frames.BadFrame, match="it holds 10 rows, its Isb-Rows header says 11"):
        frames.read_frame(good, "11")
    with pytest.raises(frames.BadFrame):
        frames.read_frame(good[: len(good) // 2])


def _provision_edge(settings, pipeline: str, stream: str) -> None:
    from nats.js.api import StreamConfig

    async def go():
        nc = await connect(settings)
        try:
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name=stream, subjects=[stream], allow_direct=True))
            await js.add_stream(StreamConfig(name=naming.dlq_stream(pipeline), subjects=[f"isb.{pipeline}.dlq.>"],
                                             duplicate_window=120.0, allow_direct=True))
            await js.create_key_value(bucket=naming.status_bucket(pipeline))
        finally:
            await nc.close()

    asyncio.run(go())


def _publish(settings, stream: str, messages: list[tuple[bytes, dict]]) -> None:
    async def go():
        nc = await connect(settings)
        try:
            js = nc.jetstream()
            for payload, headers in messages:
                await js.publish(stream, payload, headers=headers)
        finally:
            await nc.close()

    asyncio.run(go())


def test_hostile_frames_are_dead_lettered_counted_and_the_step_reads_on(spark, nats_server, tmp_path):
    from isbflow.connector.reader import dead_frames
    from isbflow.connector.source import JetStreamDataSource
    from isbflow.isb import dlq, frames
    from isbflow.isb.errors import BufferReadError
    from tests.helpers.crafted_frames import null_column_bomb, short_buffers

    settings = nats_server.settings
    pipe, vertex, stream = "hp", "parse", "isb-hp-in-parse-0"
    _provision_edge(settings, pipe, stream)

    def frame(lo: int, hi: int, rows: str | None = None) -> tuple[bytes, dict]:
        return frames.encode(_rows(lo, hi)), {frames.HDR_FRAME: frames.FRAME_FORMAT,
                                              frames.HDR_ROWS: rows if rows is not None else str(hi - lo)}

    _publish(settings, stream, [
        frame(0, 100), frame(100, 200),
        (b"\x00not an arrow frame" * 20, {frames.HDR_ROWS: "20"}),  # seq 3: garbage
        (_bomb(), {}),  # seq 4: declares 10 GiB decoded
        frame(900, 910, rows="many"),  # seq 5: its row header is not a number
        frame(910, 920, rows="11"),  # seq 6: its row header lies
        (null_column_bomb(1_000_000, ("id", "msg")), {frames.HDR_ROWS: "1000000"}),  # seq 7: null columns
        (short_buffers(_rows(920, 930), claim=1000), {frames.HDR_ROWS: "1000"}),  # seq 8: buffers too short
        frame(200, 300),
    ])
    options = {"streams": stream, "settings": settings_to_json(settings), "frameRows": "100",
               "pipeline": pipe, "vertex": vertex}
    df = spark.readStream.format("jetstream").options(**options).schema(FRAME_SCHEMA).load()
    q = (df.writeStream.format("memory").queryName("hostile_frames").option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(availableNow=True).start())
    assert q.awaitTermination(180), "the query did not finish"
    assert q.exception() is None, q.exception()
    ids = sorted(r.id for r in spark.sql("select id from hostile_frames").collect())
    assert ids == list(range(300))  # every good frame, nothing of the bad ones

    letters = asyncio.run(dlq.read_dead_letters(settings, pipe, vertex))
    by_seq = {letter["record"]["seq"]: letter for letter in letters}
    assert sorted(by_seq) == [3, 4, 5, 6, 7, 8]
    assert re.fullmatch(rf"frame 3 of buffer {stream} cannot be read at step {vertex}: not an Arrow IPC frame .*",
                        by_seq[3]["reason"])
    assert "declares 10737" in by_seq[4]["reason"] and "over the cap" in by_seq[4]["reason"]
    assert "Isb-Rows header 'many' is not a row count" in by_seq[5]["reason"]
    assert "it holds 10 rows, its Isb-Rows header says 11" in by_seq[6]["reason"]
    assert "its column 'id' (null) is null-typed" in by_seq[7]["reason"]
    assert "does not hold the 1000 records it declares" in by_seq[8]["reason"]
    assert by_seq[3]["record"]["stream"] == stream and by_seq[3]["record"]["bytes"] == 380
    assert by_seq[3]["step"] == vertex and by_seq[3]["size"] == 380

    def counted() -> int:
        async def go():
            nc = await connect(settings)
            try:
                return await dead_frames(nc, pipe, vertex)
            finally:
                await nc.close()

        return asyncio.run(go())

    assert counted() == 6

    # the same range read again (a batch read, as a retried task would): no second letter, no second count
    again = spark.read.format("jetstream").options(**options).schema(FRAME_SCHEMA).load()
    assert again.count() == 300
    assert len(asyncio.run(dlq.read_dead_letters(settings, pipe, vertex))) == 6
    assert counted() == 6

    # a reader that knows no pipeline step has nowhere to put a bad frame: it fails, naming it
    bare = {k: v for k, v in options.items() if k not in ("pipeline", "vertex")}
    from pyspark.sql.types import StructType

    reader = JetStreamDataSource(bare).streamReader(StructType.fromDDL(FRAME_SCHEMA))
    start, end = reader.initialOffset(), reader.latestOffset(reader.initialOffset(), None)
    with pytest.raises(BufferReadError, match=rf"buffer {stream}: message 3 is not a readable frame"):
        for p in reader.partitions(start, end):
            list(reader.read(p))
    reader.stop()
