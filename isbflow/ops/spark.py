"""A SparkSession for a verb that may need one: started on first use, reused when one is active,
stopped at the end only if this verb started it."""

from __future__ import annotations

from typing import Any


class SparkOnDemand:
    """``with SparkOnDemand(master, app_name) as spark_for: ... spark_for() ...``

    ``spark_for()`` returns the active SparkSession (with isbflow's data sources
    registered) or starts one on its first call; leaving the block stops the
    session only when this object started it.
    """

    def __init__(self, master: str, app_name: str, log_level: str = "WARN"):
        self.master, self.app_name, self.log_level = master, app_name, log_level
        self._own: Any = None

    def __call__(self) -> Any:
        # lazy: pyspark and steps.runner (0.3-1 s): only a verb that asks for a session loads them
        from pyspark.sql import SparkSession

        from isbflow.steps.runner import register_sources, spark_session

        if self._own is not None:
            return self._own
        active = SparkSession.getActiveSession()
        if active is not None:
            register_sources(active)
            return active
        self._own = spark_session(self.master, app_name=self.app_name)
        self._own.sparkContext.setLogLevel(self.log_level)
        return self._own

    def __enter__(self) -> SparkOnDemand:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._own is not None:
            self._own.stop()
            self._own = None
