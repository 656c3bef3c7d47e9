"""The tutorial (docs/get-started/first-pipeline.md) runs as written, from an empty folder.

Its code blocks are the test's input: a block with a ``title="PATH"`` is written to PATH, each
``bash`` block's lines are run in order with the venv's ``isbflow`` first on the PATH, as a
reader would type them (the embedded nats-server, ``isb apply``, ``produce``, one available-now
``pipeline run`` with a real Spark driver, the rows read back, ``quality run``). The outputs the
page shows are checked where they are deterministic. So the page cannot drift from the code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGE = ROOT / "docs" / "get-started" / "first-pipeline.md"
#: a fenced block: ```lang [title="path"] ... ```
BLOCK = re.compile(r'^```(\w+)(?:\s+title="([^"]+)")?\n(.*?)^```$', re.M | re.S)


def blocks(text: str) -> list[tuple[str, str | None, str]]:
    return [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(text)]


def test_the_page_has_what_the_tutorial_needs():
    found = blocks(PAGE.read_text())
    titles = {t for _, t, _ in found if t}
    assert {"pipelines/slow.yaml", "spark_apps/slow.py", "show_rows.py"} <= titles
    commands = [line for lang, _, body in found if lang == "bash" for line in body.splitlines()]
    for needed in ("isbflow validate", "isbflow nats up", "isbflow isb apply", "isbflow produce",
                   "--trigger available-now", "isbflow quality run", "isbflow nats down"):
        assert any(needed in c for c in commands), needed


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_tutorial_runs_from_an_empty_folder(tmp_path):
    from isbflow.isb.server import stop_embedded

    work = tmp_path / "shop"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("ISBFLOW_HOME", "NATS_URL", "NATS_USER", "NATS_PASSWORD")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    found = blocks(PAGE.read_text())
    outputs: dict[str, str] = {}
    try:
        for lang, title, body in found:
            if title:
                target = work / title
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(body)
                continue
            if lang != "bash":
                continue
            for line in body.splitlines():
                command = line.split("#", 1)[0].strip()
                if not command:
                    continue
                run = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                                     timeout=900)
                assert run.returncode == 0, f"{command}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
                outputs[command] = run.stdout
    finally:
        stop_embedded(work / ".isbflow")

    def shown_after(command: str) -> str:
        """The ``text`` block the page shows after the bash block holding ``command``."""
        for i, (lang, _, body) in enumerate(found):
            if lang == "bash" and command in body:
                return next(b for lang2, _, b in found[i + 1:] if lang2 == "text")
        raise AssertionError(command)

    validate = "isbflow validate -f pipelines/slow.yaml"
    assert outputs[validate].strip() == shown_after(validate).strip()
    rows = "python show_rows.py"
    assert outputs[rows].strip() == shown_after(rows).strip()  # 1,000 events, the same every run
    run = next(out for c, out in outputs.items() if "--trigger available-now" in c)
    assert "step in: stopped, committed {'src-slow-in': 1000}, dead-lettered 0" in run, run
    quality = next(out for c, out in outputs.items() if c.startswith("isbflow quality run"))
    assert "slow/requests v0: passed (1000 rows" in quality, quality
    assert "completeness in/0: proven 1..1000" in quality, quality
