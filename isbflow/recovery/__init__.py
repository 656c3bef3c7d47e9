"""Recovery and replay (DESIGN.md "Recovery and replay").

- :mod:`isbflow.isb.ledger`: the offset ledger (source offsets each sink holds);
- :mod:`isbflow.recovery.recover`: detect buffer loss, recreate, rewind, replay, verify.
"""
