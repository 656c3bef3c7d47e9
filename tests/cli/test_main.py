"""``isbflow``'s entry point: a NATS failure in the middle of a command is one line, not a traceback."""

from __future__ import annotations

import nats.errors
import pytest

import isbflow.cli as cli


def test_a_nats_failure_mid_command_is_one_line_and_exit_1(monkeypatch, capsys):
    def boom():
        raise nats.errors.TimeoutError

    monkeypatch.setattr(cli, "app", boom)
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "the ISB service stopped answering in the middle of the command: nats TimeoutError" in err, err
    assert "Traceback" not in err


def test_other_errors_are_not_dressed_up_as_nats_ones(monkeypatch):
    def boom():
        raise KeyError("x")

    monkeypatch.setattr(cli, "app", boom)
    with pytest.raises(KeyError):
        cli.main()
