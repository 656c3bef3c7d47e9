"""Hooks: the ISB service (NATS JetStream) as an Airflow connection."""
