"""Recovery and replay (docs/concepts/replays.md).

- :mod:`isbflow.isb.ledger`: the offset ledger (source offsets each sink holds);
- :mod:`isbflow.recovery.job`: what both replays share (connection, phases, published report);
- :mod:`isbflow.recovery.recover`: detect buffer loss, recreate, rewind, replay, verify
  (:mod:`isbflow.recovery.plan`: its dry run);
- :mod:`isbflow.recovery.reprocess`: run a source range again and replace its output
  (:mod:`~isbflow.recovery.reprocess_plan`, :mod:`~isbflow.recovery.reprocess_read`,
  :mod:`~isbflow.recovery.reprocess_windows`);
- :mod:`isbflow.recovery.aggregates`: recompute an aggregate sink's windows from its raw sink.
"""
