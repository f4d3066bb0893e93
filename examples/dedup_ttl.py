"""Drop duplicate events by id, remembering seen ids for a limited time.

Each Kinesis record is a JSON event `{"id": "...", ...}`. Producers must give duplicates
the same partition key (the id itself, or e.g. the device that sends it): only the current
key's state is reachable, so ids are remembered per partition key, in the key's map state.

An event is emitted unchanged the first time its id is seen; copies in batches less than
`TTL_MS` of processing time after that first sighting are dropped. Duplicates do not
extend the window: once `TTL_MS` has passed since the accepted copy, the id is forgotten
(and its entry purged), and the next copy is emitted again as a new first sighting.

Run it on the local emulators (`docs/getting-started.md`). `shardless produce` gives each
event an `id` that depends only on `--seed` and the event's position, so producing twice
with the same seed puts every event into the stream twice:

    shardless produce --stream dups --events 1000 --users 20
    shardless produce --stream dups --events 1000 --users 20
    shardless run examples/dedup_ttl.py --app dedup --stream dups --available-now \
        --output /tmp/dedup-out                             # 2,000 records in, 1,000 out
    shardless state get --app dedup --key user-00003        # the ids it remembers

`shardless state` shows remembered ids until they are purged, including ones whose TTL
has passed (a handler never sees those).
"""

TTL_MS = 10 * 60_000


def process(event, ctx):
    body = event.json()
    seen = ctx.state.map
    if body["id"] in seen:
        return
    seen.set(body["id"], ctx.now_ms, ttl_ms=TTL_MS)  # the value: when it was accepted
    ctx.emit(body)
