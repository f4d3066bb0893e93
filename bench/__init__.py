"""Benchmarks of shardless internals, run without Spark (`python -m bench.<name>`)."""
