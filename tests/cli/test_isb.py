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
