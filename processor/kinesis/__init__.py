"""The Kinesis source: shard discovery and lineage, planned reads, recorded batch ends."""
