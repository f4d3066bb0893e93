"""User sessions that close after a processing-time inactivity gap.

Input: JSON events with a `page` field, partition key = the user id, e.g.
`{"user": "u1", "page": "/home"}`. `shardless produce` writes such events.

A user's open session lives in `ctx.state`; every event extends it and moves the key's
single pending timer to `GAP_MS` after the batch's processing time. When the timer fires,
the session is emitted and its state deleted:

    {"user": "u1", "start_ms": <first arrival>, "end_ms": <last arrival>, "events": 3,
     "pages": ["/home", "/cart", "/checkout"]}

An event that arrives once the gap has already passed (its batch runs at or after the
pending timer, before the timer fires) closes the old session first and starts a new one.

Run it on the local emulators (`docs/getting-started.md`); the gap is 30 minutes unless
the environment variable SESSION_GAP_MS says otherwise (read once, where `shardless run`
starts):

    shardless produce --stream clicks --events 2000 --users 50
    SESSION_GAP_MS=5000 shardless run examples/sessionization.py --app sessions \
        --stream clicks --available-now --output /tmp/sessions-out
    shardless state get --app sessions --key user-00010     # an open session

Timers fire in batches that Spark runs: a second `--available-now` run, more than the gap
later and with new records in the stream, closes every session of the first run; a
continuous run (`--trigger '5 seconds'`) closes them without new records.
"""

import os

GAP_MS = int(os.environ.get("SESSION_GAP_MS", 30 * 60_000))


class Sessions:
    def process(self, event, ctx):
        session = ctx.state.get()
        for timer in ctx.timers.list():  # at most one: the open session's deadline
            ctx.timers.delete(timer.ts, timer.kind)
            if timer.ts <= ctx.now_ms:  # the gap passed before this event
                emit_session(ctx, session)
                session = None
        if session is None:
            session = {"start_ms": event.arrival_ms, "events": 0, "pages": []}
        session["end_ms"] = event.arrival_ms
        session["events"] += 1
        session["pages"].append(event.json()["page"])
        ctx.state.set(session)
        ctx.timers.set(ctx.now_ms + GAP_MS)

    def on_timer(self, timer, ctx):
        emit_session(ctx, ctx.state.get())
        ctx.state.delete()


def emit_session(ctx, session):
    ctx.emit(
        {
            "user": ctx.key,
            "start_ms": session["start_ms"],
            "end_ms": session["end_ms"],
            "events": session["events"],
            "pages": session["pages"],
        }
    )


handler = Sessions
