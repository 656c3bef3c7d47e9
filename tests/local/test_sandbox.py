"""isbflow.local.sandbox: a folder hidden from a process and what it starts, the rest in reach.

Each check runs in a subprocess of its own: the restriction cannot be undone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from isbflow.local.sandbox import MIN_ABI, landlock_abi


@pytest.fixture(autouse=True)
def _landlock():
    """Landlock is what these tests check: a kernel without it fails them, naming why, rather than
    skipping them unseen (the platform then runs unconfined, with a warning)."""
    if landlock_abi() < MIN_ABI:
        pytest.fail(f"this kernel has no Landlock ABI {MIN_ABI} (found {landlock_abi()}): a driver's user code "
                    "could read the ISB service's password files here")

CHECK = textwrap.dedent('''
    import os, subprocess, sys, tempfile
    from pathlib import Path
    from isbflow.local.sandbox import forget_env, hide

    home = Path(sys.argv[1])
    nats = home / "nats"
    outcomes = {}

    def outcome(name, fn):
        try:
            fn()
            outcomes[name] = "ok"
        except PermissionError:
            outcomes[name] = "denied"

    assert forget_env(["NATS_PASSWORD"]) == ["NATS_PASSWORD"]
    hidden = hide(nats, keep=[home / "checkpoints" / "p", home / "sinks" / "t"],
                  readable=[nats / "pipeline-p.password"])
    assert hidden is not None and hidden.folder == nats.resolve()
    outcome("read admin", (nats / "password").read_text)
    outcome("read other role", (nats / "pipeline-q.password").read_text)
    outcome("write admin", lambda: (nats / "password").write_text("mine"))
    outcome("remove admin", (nats / "password").unlink)
    outcome("create in nats", lambda: (nats / "pipeline-r.password").write_text("mine"))
    outcome("read own role", (nats / "pipeline-p.password").read_text)
    outcome("checkpoints", lambda: ((home / "checkpoints" / "p").mkdir(), (home / "checkpoints" / "p" / "0").write_text("x")))
    table = home / "sinks" / "t" / "_delta_log"
    outcome("sink made later", lambda: (table.mkdir(parents=True), (table / "0.json").write_text("{}"),
                                        (table / "0.json").read_text()))
    outcome("move between folders", lambda: os.rename(table / "0.json", home / "checkpoints" / "p" / "1"))
    outcome("temp", lambda: Path(tempfile.mkstemp()[1]).read_text())
    outcome("venv", lambda: Path(sys.executable).read_bytes())
    child = subprocess.run([sys.executable, "-c", f"open({str(nats / 'password')!r}).read()"], capture_output=True)
    outcomes["child reads admin"] = "denied" if b"PermissionError" in child.stderr else "ok"
    outcomes["env"] = "clean" if b"hunter2" not in Path("/proc/self/environ").read_bytes() else "holds it"
    print(outcomes)
''')


def test_a_hidden_folder_is_out_of_reach_and_the_rest_is_not(tmp_path):
    """The admin's and another role's password: not read, written, removed, nor a file created
    beside them, by the process or a child it starts; its own role's file, the checkpoints, a sink
    table made later inside a folder named in ``keep``, a move between folders, the temporary folder
    (the data dir is under it) and the venv: as before; a secret variable is gone from
    ``/proc/self/environ``. Fails without the restriction (``ISBFLOW_SANDBOX=off``)."""
    home = tmp_path / "home"
    (home / "nats").mkdir(parents=True)
    for name in ("password", "pipeline-p.password", "pipeline-q.password"):
        (home / "nats" / name).write_text("hunter2")
    (home / "checkpoints").mkdir()
    proc = subprocess.run([sys.executable, "-c", CHECK, str(home)], capture_output=True, text=True,
                          env={**os.environ, "NATS_PASSWORD": "hunter2"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert eval(proc.stdout) == {
        "read admin": "denied", "read other role": "denied", "write admin": "denied", "remove admin": "denied",
        "create in nats": "denied", "read own role": "ok", "checkpoints": "ok", "sink made later": "ok",
        "move between folders": "ok", "temp": "ok", "venv": "ok", "child reads admin": "denied", "env": "clean"}
    assert (home / "nats" / "password").read_text() == "hunter2"
    assert not (home / "nats" / "pipeline-r.password").exists()
