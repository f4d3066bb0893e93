"""Operator tools: `shardless state`, export, and the state as a Spark data source."""
