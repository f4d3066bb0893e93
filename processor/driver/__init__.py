"""The driver: configuration, query wiring, checkpoint and progress records, Spark."""
