"""The spec's plain values (default limits, the ``onFull`` choices) for code that must not load
the models: Spark's Python workers read them through the connector's options, and importing
:mod:`isbflow.spec.models` (pydantic, every model) costs a worker process ~0.3 CPU-seconds."""

from enum import StrEnum

READ_BATCH_SIZE = 100_000
BUFFER_MAX_LENGTH = 1_000_000
BUFFER_USAGE_LIMIT = 80  # percent, as in Numaflow (the models keep it as the fraction 0.8)
#: the default trigger interval of a source step (its latency budget), from bench/cost.py's curve: the
#: demo at 100 events/s costs ~0.5 of a core with an end-to-end p50 under 4 s (docs/performance.md)
READ_TIMEOUT_S = 5.0


class OnFull(StrEnum):
    """What a writer does when its buffer is full (Numaflow's ``onFull``)."""

    RETRY_UNTIL_SUCCESS = "retryUntilSuccess"
    DISCARD_LATEST = "discardLatest"
