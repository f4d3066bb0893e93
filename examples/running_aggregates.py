"""Per-user running aggregates of an amount, and counts per category.

Each Kinesis record is a JSON event `{"user": "u1", "amount": 12.5, "category": "books"}`
whose partition key is the user id. The user's value holds count, sum, min and max; the
counts per category live in the key's map state (one entry per category). Every event
emits the user's updated aggregate:

    {"user": "u1", "count": 3, "sum": 40.0, "min": 2.5, "max": 25.0, "mean": 13.33...,
     "categories": {"books": 2, "games": 1}}

Run it on the local emulators (`docs/getting-started.md`); `shardless produce` writes
such events (with more fields, which this app ignores):

    shardless produce --stream clicks --events 2000 --users 50
    shardless run examples/running_aggregates.py --app aggregates --stream clicks \
        --available-now --output /tmp/aggregates-out
    shardless state get --app aggregates --key user-00010   # the value and its map entries
"""


def process(event, ctx):
    body = event.json()
    amount = body["amount"]
    agg = ctx.state.get()
    if agg is None:
        agg = {"count": 0, "sum": 0, "min": amount, "max": amount}
    agg["count"] += 1
    agg["sum"] += amount
    agg["min"] = min(agg["min"], amount)
    agg["max"] = max(agg["max"], amount)
    ctx.state.set(agg)

    categories = ctx.state.map
    categories.set(body["category"], categories.get(body["category"], 0) + 1)

    ctx.emit(
        {
            "user": event.key,
            **agg,
            "mean": agg["sum"] / agg["count"],
            "categories": dict(categories.items()),
        }
    )
