"""The processor: what runs a user's handlers on Spark, in rooms by role.

- `api`: what a handler sees (event, context, state views), loading an app, record policies.
- `runtime`: a group's batch inside `applyInPandasWithState`: slice stores, owner processes,
  routing and placement, dead letters.
- `kinesis`: the Kinesis source and sink.
- `driver`: configuration, query wiring, checkpoint and progress records, the Spark session.
- `tools`: `shardless state`, export and the state data source.
- `local`: emulators, moto patches, the producer, the demo and the fault harness (development).

`processor` builds on `changelog` and `state`.
"""
