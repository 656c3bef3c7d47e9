"""JetStream as an inter-step buffer store: what is JetStream's own behind the roles of
:mod:`isbflow.isb.store`. This package imports no other store (``make lint``)."""
