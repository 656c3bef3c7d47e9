"""The inter-step buffer (ISB) service on NATS JetStream.

An ISB is one JetStream stream per edge partition. Producers publish acked
(JetStream drops unacked publishes under load); readers never delete what
they read: space is released only after the downstream commit. Streams,
subjects and buckets are named deterministically (:mod:`isbflow.isb.naming`).
"""
