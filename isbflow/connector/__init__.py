"""The Spark connector for JetStream: ``format("jetstream")`` reads and writes buffers.

- :mod:`isbflow.connector.source`: :class:`JetStreamDataSource` (short name
  ``jetstream``), light to unpickle;
- :mod:`isbflow.connector.reader`: its streaming and batch readers;
- :mod:`isbflow.connector.writer`: its stream writer;
- :mod:`isbflow.connector.options`: the options, and NatsSettings as an option;
- :mod:`isbflow.connector.offsets`: the offset JSON and the read-limit split;
- :mod:`isbflow.isb.read`: exact range reads (batched direct get);
- :mod:`isbflow.isb.release`: freeing buffer space after the downstream commit;
- :mod:`isbflow.isb.errors`: ``BufferLost`` and the other user-facing errors.

Nothing is imported here, so ``isbflow.isb.release`` and ``.errors`` can
be used without loading pyspark.
"""
