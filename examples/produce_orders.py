"""Sample input for `enrichment.py`: user profiles and orders on one stream, keyed by user.

    python examples/produce_orders.py --stream orders --users 50 --orders 2000

(with the Python that has shardless installed, e.g. `.venv/bin/python`, and the local
emulators' variables in the environment: `eval "$(shardless local up)"`; without them it
writes to real AWS). It creates the stream if needed and puts, in this order per user:

- a few orders before the user's first profile (the app buffers them),
- the first profile (the app emits the buffered orders with it),
- more orders, and for some users a second profile that applies to later orders only.

Every tenth user (`user-00009`, `user-00019`, ...) never gets a profile: their orders stay
buffered in state, up to the app's `MAX_BUFFERED`. The same `--seed` gives the same events.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

COUNTRIES = ("DE", "FR", "NL", "US")
TIERS = ("bronze", "silver", "gold")


def events(users: int, orders: int, seed: int = 7) -> list[dict]:
    """The events in the order they are put: profiles and orders, both with a `user`."""
    rng = random.Random(seed)
    names = [f"user-{i:05d}" for i in range(users)]
    first_after = {u: rng.randint(0, 5) for u in names}  # orders before the first profile
    second_after = {u: first_after[u] + rng.randint(3, 30) for u in names if rng.random() < 0.3}
    placed = dict.fromkeys(names, 0)
    out: list[dict] = []

    def profile(user: str) -> dict:
        return {
            "type": "profile",
            "user": user,
            "country": rng.choice(COUNTRIES),
            "tier": rng.choice(TIERS),
        }

    for n in range(orders):
        user = rng.choice(names)
        if int(user[-5:]) % 10 != 9 and placed[user] in (first_after[user], second_after.get(user)):
            out.append(profile(user))
        placed[user] += 1
        out.append(
            {"type": "order", "user": user, "order_id": f"o-{n}", "amount": rng.randint(1, 200)}
        )
    return out


def put(kinesis, stream: str, batch: list[dict]) -> None:  # noqa: ANN001 - boto3 client
    """Put events keyed by their user, 500 per call, retrying the records Kinesis refused."""
    for lo in range(0, len(batch), 500):
        chunk = batch[lo : lo + 500]
        pending = [{"PartitionKey": e["user"], "Data": json.dumps(e).encode()} for e in chunk]
        while pending:
            result = kinesis.put_records(StreamName=stream, Records=pending)
            pending = [
                r for r, res in zip(pending, result["Records"], strict=True) if "ErrorCode" in res
            ]


def main(argv: list[str] | None = None) -> int:
    from shardless.changelog import aws
    from shardless.processor.local.producer import ensure_stream

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stream", required=True)
    p.add_argument("--shards", type=int, default=2, help="if the stream must be created")
    p.add_argument("--users", type=int, default=50)
    p.add_argument("--orders", type=int, default=2000)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    kinesis = aws.client("kinesis")
    ensure_stream(kinesis, args.stream, args.shards)
    batch = events(args.users, args.orders, args.seed)
    put(kinesis, args.stream, batch)
    profiles = sum(1 for e in batch if e["type"] == "profile")
    print(f"put {len(batch) - profiles} orders and {profiles} profiles into {args.stream}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
