"""Enrich orders with the latest user profile, a reference table kept in state.

Profiles and orders arrive on the same stream, both with the user id as partition key:

    {"type": "profile", "user": "u1", "country": "DE", "tier": "gold"}
    {"type": "order", "user": "u1", "order_id": "o-17", "amount": 30}

The latest profile is the key's value. An order is emitted joined with it:

    {"user": "u1", "order": {...the order...}, "profile": {...the latest profile...}}

Orders that arrive before any profile are buffered in the key's map state, up to
`MAX_BUFFERED` per user, and emitted in arrival order when the profile arrives. An early
order that finds the buffer full is emitted at once with `"profile": null`, not dropped.
A later profile replaces the stored one and applies to later orders only. Records of any
other `type` are ignored; a record without a `type` fails the batch (KeyError), so
`shardless produce`'s events are not input for this app.

Run it on the local emulators (`docs/getting-started.md`), with input from
`examples/produce_orders.py`:

    python examples/produce_orders.py --stream orders --users 50 --orders 2000
    shardless run examples/enrichment.py --app enrich --stream orders --available-now \
        --output /tmp/enrich-out
    shardless state get --app enrich --key user-00001     # the profile (value)
    shardless state get --app enrich --key user-00009     # buffered orders (map entries)
"""

MAX_BUFFERED = 100


def process(event, ctx):
    body = event.json()
    if body["type"] == "profile":
        ctx.state.set(body)
        buffered = ctx.state.map
        for _, order in buffered.items():  # sub-keys sort in arrival order
            emit_order(ctx, order, body)
        buffered.clear()
    elif body["type"] == "order":
        profile = ctx.state.get()
        if profile is not None:
            emit_order(ctx, body, profile)
            return
        pending = len(ctx.state.map.keys())
        if pending < MAX_BUFFERED:
            ctx.state.map.set(f"{pending:06d}", body)  # zero-padded: byte order is arrival order
        else:
            emit_order(ctx, body, None)
    # other record types are not ours: ignore them


def emit_order(ctx, order, profile):
    ctx.emit({"user": ctx.key, "order": order, "profile": profile})
