"""isbflow: streaming pipelines on Spark, NATS JetStream and Airflow."""
__version__ = "0.1.0"
