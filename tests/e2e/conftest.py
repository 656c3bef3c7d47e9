"""The whole platform, started once: ``isbflow platform up`` in the foreground, as ``make run`` runs it.

:func:`demo_platform` (session scope) is shared by every test that only reads the
running platform (the browser tests, the lifecycle's first checks); the lifecycle
module (``test_platform.py``, run last of this folder) stops it with Ctrl-C, then
starts and stops it again. Whatever is left at the end is stopped by PID.
"""

from __future__ import annotations

import pytest

from tests.helpers.live_platform import Scenario, demo_scenario


@pytest.fixture(scope="session")
def demo_platform(tmp_path_factory) -> Scenario:
    yield from demo_scenario(tmp_path_factory)
