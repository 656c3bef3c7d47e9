"""``isbflow isb ...`` run as a user would: the installed console script, in a subprocess."""

from __future__ import annotations

import asyncio
import json
import subprocess

from typer.testing import CliRunner

from isbflow.cli import app
from isbflow.isb import provision
from isbflow.isb.server import free_port
from isbflow.spec import load_specs
from tests.conftest import ROOT
from tests.helpers.provision import infos, publish, write_spec

ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")


def isb(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([ISBFLOW, "isb", *args], capture_output=True, text=True, timeout=60,
                          input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL, cwd=ROOT)


def test_apply_diff_status_delete_round_trip(nats_server, tmp_path):
    f = str(write_spec(tmp_path))
    url = ["--nats-url", nats_server.url]

    first = isb("apply", "-f", f, *url, "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["changed"] is True and len(report["resources"]) == 13
    assert {r["action"] for r in report["resources"]} == {"created"}

    in_sync = isb("diff", "-f", f, *url, "--json")
    assert in_sync.returncode == 0 and json.loads(in_sync.stdout) == {
        "pipeline": "logs", "in_sync": True, "drift": []}

    publish(nats_server.settings, "isb.logs.in.parse.1", 4)
    status = isb("status", "-f", f, "--data-dir", str(nats_server.data_dir), "--json")
    assert status.returncode == 0, status.stderr
    by = {r["name"]: r for r in json.loads(status.stdout)["resources"]}
    assert by["isb-logs-in-parse-1"]["messages"] == 4 and by["isb-logs-in-parse-0"]["messages"] == 0
    # the server's own config of each stream, as applied from the spec
    config = by["isb-logs-in-parse-1"]["config"]
    assert {k: config[k] for k in ("retention", "storage", "discard", "num_replicas", "duplicate_window",
                                   "max_msgs", "max_bytes", "max_age")} == {
        "retention": "limits", "storage": "file", "discard": "old", "num_replicas": 1, "duplicate_window": 120.0,
        "max_msgs": -1, "max_bytes": 64 * 2**20, "max_age": 72 * 3600.0}
    table = isb("status", "-f", f, *url)
    assert table.returncode == 0 and "isb-logs-in-parse-1" in table.stdout

    refused = isb("delete", "-f", f, *url)  # no terminal, no --yes
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert all(infos(nats_server.settings, load_specs(f)).values())  # nothing deleted

    deleted = isb("delete", "-f", f, *url, "--yes", "--json")
    assert deleted.returncode == 0, deleted.stderr
    assert len(json.loads(deleted.stdout)["deleted"]) == 13
    missing = isb("diff", "-f", f, *url, "--json")
    assert missing.returncode == 3
    assert {d["field"] for d in json.loads(missing.stdout)["drift"]} == {"exists"}


def test_drift_exit_codes(nats_server, tmp_path):
    url = ["--nats-url", nats_server.url]
    asyncio.run(provision.apply(nats_server.settings, load_specs(write_spec(tmp_path))))
    changed = str(write_spec(tmp_path, "changed.yaml", storage="memory", maxMsgs=99))

    diff = isb("diff", "-f", changed, *url)
    assert diff.returncode == 3
    assert "storage" in diff.stdout and "max_msgs" in diff.stdout
    assert "recreate: needs a recreate" in diff.stdout and "safe: in place, safe" in diff.stdout

    applied = isb("apply", "-f", changed, *url)
    assert applied.returncode == 1
    assert "refused, nothing was applied" in applied.stderr and "re-run with --recreate" in applied.stderr
    assert "refused" in applied.stdout and "storage: file -> memory" in applied.stdout
    assert isb("diff", "-f", changed, *url).returncode == 3  # nothing applied: max_msgs still differs too

    recreated = isb("apply", "-f", changed, *url, "--recreate", "--json")
    assert recreated.returncode == 0, recreated.stderr
    assert {r["action"] for r in json.loads(recreated.stdout)["resources"]} == {"recreated", "unchanged"}
    assert isb("diff", "-f", changed, *url).returncode == 0


def test_a_change_that_may_discard_unread_messages_needs_force(nats_server, tmp_path):
    """diff shows each change's class; apply refuses (exit 1) naming stream, field, old -> new and
    the unread count, and applies nothing; --force applies it."""
    url = ["--nats-url", nats_server.url]
    asyncio.run(provision.apply(nats_server.settings, load_specs(write_spec(tmp_path))))
    publish(nats_server.settings, "isb.logs.in.parse.0", 100)
    lowered = str(write_spec(tmp_path, "lowered.yaml", maxMsgs=10))

    diff = isb("diff", "-f", lowered, *url, "--json")
    assert diff.returncode == 3
    by = {d["resource"]: d for d in json.loads(diff.stdout)["drift"]}
    assert (by["isb-logs-in-parse-0"]["class"], by["isb-logs-in-parse-0"]["unread"]) == ("may-discard", 100)
    assert (by["isb-logs-in-parse-1"]["class"], by["isb-logs-in-parse-1"]["unread"]) == ("safe", 0)
    text = isb("diff", "-f", lowered, *url)
    assert "may discard unread messages" in text.stdout

    refused = isb("apply", "-f", lowered, *url)
    assert refused.returncode == 1
    assert ("isb-logs-in-parse-0: max_msgs -1 -> 10: may discard unread messages, 100 unread message(s)"
            in refused.stderr)
    assert "Traceback" not in refused.stderr
    as_json = isb("apply", "-f", lowered, *url, "--json")
    assert as_json.returncode == 1
    out = json.loads(as_json.stdout)
    assert out["changed"] is False and out["refused"] == 1 and "refused" in out["error"]
    server = infos(nats_server.settings, load_specs(lowered))
    assert server["isb-logs-in-parse-0"].state.messages == 100
    assert server["isb-logs-in-parse-1"].config.max_msgs == -1  # safe on its own, but not applied either

    forced = isb("apply", "-f", lowered, *url, "--force")
    assert forced.returncode == 0, forced.stderr
    assert infos(nats_server.settings, load_specs(lowered))["isb-logs-in-parse-0"].state.messages == 10


def test_unreachable_server_is_one_line_and_exit_1(tmp_path):
    url = f"nats://127.0.0.1:{free_port()}"
    r = isb("status", "-f", str(write_spec(tmp_path)), "--nats-url", url)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_help_teaches_exit_codes_and_examples():
    runner = CliRunner()
    r = runner.invoke(app, ["isb", "diff", "--help"], terminal_width=200)
    assert r.exit_code == 0
    assert "3 when there is drift" in " ".join(r.stdout.split())
    assert "isbflow isb diff -f pipelines/logs.yaml" in r.stdout
    assert "--recreate" in runner.invoke(app, ["isb", "apply", "--help"], terminal_width=200).stdout


# ------------------------------------------------------------------ isb up / down: the spec's own service

REDIS_SPEC = """\
kind: InterStepBufferService
metadata:
  name: default
spec:
  redis:
    native:
      settings:
        redis: |
          maxmemory 64mb
"""


def _stop_all(data_dir) -> None:
    """The servers recorded under ``data_dir`` stopped by their PIDs, whatever the test did."""
    from isbflow.isb.redis.server import stop_redis
    from isbflow.isb.server import stop_embedded

    stop_redis(data_dir)
    stop_embedded(data_dir)


def test_up_and_down_a_redis_spec(tmp_path):
    import redis

    from isbflow.local.procs import process_alive

    f, dd = tmp_path / "redis.yaml", tmp_path / "data"
    f.write_text(REDIS_SPEC)
    args = ["-f", str(f), "--data-dir", str(dd)]
    try:
        first = isb("up", *args, "--json")
        assert first.returncode == 0, first.stderr
        up = json.loads(first.stdout)
        assert (up["store"], up["started"], up["settings"]) == ("redis", True, {"maxmemory": "64mb"})
        password = (dd / "redis" / "password").read_text().strip()
        assert password not in first.stdout
        client = redis.Redis(host="127.0.0.1", port=up["port"], password=password, socket_timeout=5)
        try:
            assert client.ping() is True
        finally:
            client.close()

        again = isb("up", *args)
        assert again.returncode == 0, again.stderr
        assert "already running, reused" in again.stdout and f"pid {up['pid']}" in again.stdout
        assert f"REDIS_URL=redis://127.0.0.1:{up['port']}" in again.stdout and password not in again.stdout

        down = isb("down", *args, "--json")
        assert down.returncode == 0, down.stderr
        assert json.loads(down.stdout) == {"service": "default", "store": "redis", "stopped": [up["pid"]]}
        assert not process_alive(up["pid"])
    finally:
        _stop_all(dd)


def test_up_and_down_a_jetstream_embedded_spec(tmp_path):
    from isbflow.local.procs import process_alive

    f, dd = write_spec(tmp_path), tmp_path / "data"  # a pipeline on the default service: jetstream, embedded
    args = ["-f", str(f), "--data-dir", str(dd)]
    try:
        first = isb("up", *args)
        assert first.returncode == 0, first.stderr
        assert "nats-server up (started): ISB service default (jetstream, embedded), 1 node(s)" in first.stdout
        state = json.loads(isb("up", *args, "--json").stdout)
        assert state["started"] is False and state["alive"] == [True]
        pid = state["nodes"][0]["pid"]
        down = isb("down", *args)
        assert down.returncode == 0 and f"pid {pid}" in down.stdout, down.stderr
        assert not process_alive(pid)
    finally:
        _stop_all(dd)


def test_up_refuses_an_external_service_in_one_line(tmp_path):
    f = tmp_path / "ext.yaml"
    f.write_text("kind: InterStepBufferService\nspec:\n  redis:\n    external:\n      url: 10.0.0.1:6379\n")
    for verb in ("up", "down"):
        r = isb(verb, "-f", str(f), "--data-dir", str(tmp_path / "data"))
        assert r.returncode == 2
        assert r.stderr.strip() == ("ISB service 'default' is external (redis.external.url 10.0.0.1:6379): isbflow "
                                    "starts nothing; that server is started and stopped by its operator")


def test_apply_on_a_redis_spec_without_its_server_is_one_clear_line(tmp_path):
    import yaml

    f = write_spec(tmp_path)
    docs = list(yaml.safe_load_all(f.read_text()))
    next(d for d in docs if d["kind"] == "InterStepBufferService")["spec"] = {"redis": {"native": {}}}
    f.write_text(yaml.safe_dump_all(docs))
    r = isb("apply", "-f", str(f), "--data-dir", str(tmp_path / "data"))  # no redis-server started there
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip().splitlines()[0]]
    assert "no Redis ISB service: nothing running under" in r.stderr, r.stderr


def test_up_help_teaches_both_stores_with_examples():
    r = CliRunner().invoke(app, ["isb", "up", "--help"], terminal_width=200)
    assert r.exit_code == 0
    text = " ".join(r.stdout.split())
    assert "isbflow isb up -f pipelines/logs.yaml" in text and "redis.native" in text and "url: embedded" in text
    assert "rescale and scale to zero, as on JetStream" in text
