"""Per-user event counts and last-seen times.

Each Kinesis record is a JSON event `{"user": ..., "ts": <epoch ms>, "action": ...}` whose
partition key is the user id. The state of a user is `{"count": n, "last_seen": ts}`;
every event emits the user's updated state. It is the app that `make demo` runs.

Run it on the local emulators (`docs/getting-started.md`); `shardless produce` writes
such events:

    shardless produce --stream clicks --events 2000 --users 50
    shardless run examples/user_activity.py --app activity --stream clicks \
        --available-now --output /tmp/activity-out
    shardless state get --app activity --key user-00010
"""


def process(event, ctx):
    body = event.json()
    seen = ctx.state.get({"count": 0, "last_seen": 0})
    seen["count"] += 1
    seen["last_seen"] = max(seen["last_seen"], body["ts"])
    ctx.state.set(seen)
    ctx.emit({"user": event.key, "count": seen["count"], "last_seen": seen["last_seen"]})
