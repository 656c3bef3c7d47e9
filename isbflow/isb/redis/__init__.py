"""Redis Streams as an inter-step buffer store (the second store beside JetStream).

A buffer partition is one Redis stream key; a frame (the Arrow IPC bytes of
:mod:`isbflow.isb.frames`) is one entry; an offset is an integer, as JetStream's stream sequences:
entry ``0-<n>`` is offset ``n``, counting from 1 (:mod:`~isbflow.isb.redis.keys`), so the layers
above (the connector's offsets, the ledger's ranges, recovery) read both stores alike. The
key-value buckets (control, status, ledger, reference tables) are one hash each
(:mod:`~isbflow.isb.redis.kv`), reached with the buffers through one
:class:`~isbflow.isb.redis.store.RedisStore`. Redis has no duplicates window, so each write runs
one Lua script that appends a frame only when its frame id is not yet recorded and records it with
the entry, atomically (:mod:`isbflow.isb.redis.scripts`): a retried or re-executed write stores
nothing twice. Every partition has an incarnation key, so a flushed, restarted-without-persistence
or failed-over server reads as buffer loss, never as an empty buffer.

The modules: :mod:`~isbflow.isb.redis.keys` (key names, entry ids),
:mod:`~isbflow.isb.redis.scripts` (the Lua scripts and how they are called),
:mod:`~isbflow.isb.redis.buffers` (the roles of :mod:`isbflow.isb.store`),
:mod:`~isbflow.isb.redis.loss` (loss judged from a buffer's state),
:mod:`~isbflow.isb.redis.acl` (one ACL user per role), :mod:`~isbflow.isb.redis.server`
(an embedded redis-server), :mod:`~isbflow.isb.redis.client` (a client for a role),
:mod:`~isbflow.isb.redis.kv` (the key-value buckets), :mod:`~isbflow.isb.redis.store` (the
store: buckets and buffers on one client).
This package imports no other store.
"""
