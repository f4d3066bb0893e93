"""Drop duplicate events by id, remembering seen ids for a limited time.

Each Kinesis record is a JSON event `{"id": "...", ...}`. Producers must give duplicates
the same partition key (the id itself, or e.g. the device that sends it): only the current
key's state is reachable, so ids are remembered per partition key, in the key's map state.

An event is emitted unchanged the first time its id is seen; copies arriving within `TTL_MS`
of that first sighting are dropped. Duplicates do not extend the window: once `TTL_MS` has
passed since the accepted copy, the id is forgotten (and its entry purged), and the next
copy is emitted again as a new first sighting.
"""

TTL_MS = 10 * 60_000


def process(event, ctx):
    body = event.json()
    seen = ctx.state.map
    if body["id"] in seen:
        return
    seen.set(body["id"], ctx.now_ms, ttl_ms=TTL_MS)  # the value: when it was accepted
    ctx.emit(body)
