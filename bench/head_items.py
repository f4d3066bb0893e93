"""What a batch's DynamoDB commit of 256 slice heads costs on the project's moto server, by
table layout (`python -m bench.head_items --json`).

A batch that changes every slice writes one head per slice (`shardless.changelog.durable`):
conditional Puts, 100 to a `TransactWriteItems`. The alternative weighed in `docs/benchmarks.md` is
one item per block of consecutive slices, one `UpdateItem` per block that sets each changed slice's
head and checks each one's own token. Both are measured here, in CPU seconds per batch of the client
and moto together (moto in-process through `mock_aws`, with the fixes of
`shardless.processor.local.moto_server`), and, for the per-slice layout, also on moto as released:
the cost of those fixes. Every variant runs in its own process (the fixes patch moto's module),
interleaved over `--rounds`; the figures are medians, and the ratios are to the per-slice layout
measured in the same run.

Items are the size of a real head: a 1,700-byte log and snapshot list per slice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from shardless.changelog.resources import TABLE_SCHEMA

SLICES = 256
HEAD_BYTES = 1_700

_VARIANTS = {  # name: (layout, slices per block, moto's fixes on)
    "per_slice": ("per_slice", 1, True),
    "per_slice_moto_as_released": ("per_slice", 1, False),
    "blocks_of_16": ("blocks", 16, True),
    "blocks_of_32": ("blocks", 32, True),
    "blocks_of_64": ("blocks", 64, True),
}


def _table(ddb: Any) -> None:
    """A table laid out as an application's."""
    ddb.create_table(TableName="t", **TABLE_SCHEMA)


def _per_slice_batch(ddb: Any, logs: dict[int, bytes], version: int) -> None:
    """Today's layout: `shardless.changelog.layout.head_item` under `head_condition`,
    100 a transaction."""
    from shardless.changelog.layout import Head, head_condition, head_item

    items = []
    for s in range(SLICES):
        old = None if s not in logs else Head(s, version - 1, "q", 0, log_bytes=logs[s])
        new = Head(s, version, "query", version, log_bytes=os.urandom(HEAD_BYTES - 200))
        items.append(
            {"Put": {"TableName": "t", "Item": head_item(new), **head_condition(old)}}
        )  # fmt: skip
        logs[s] = new.log_bytes or b""
    for lo in range(0, SLICES, 100):
        ddb.transact_write_items(TransactItems=items[lo : lo + 100])


def _block_batch(ddb: Any, tokens: dict[int, str], block: int) -> None:
    """One item per block: each slice's head as a binary attribute and a token attribute
    that its condition checks; blocks of a batch in transactions of up to 100."""
    updates = []
    for b in range(SLICES // block):
        names: dict[str, str] = {}
        values: dict[str, Any] = {}
        sets, conditions = [], []
        for s in range(b * block, (b + 1) * block):
            names[f"#h{s}"], names[f"#t{s}"] = f"h{s:05d}", f"t{s:05d}"
            token = os.urandom(8).hex()
            values[f":h{s}"] = {"B": os.urandom(HEAD_BYTES)}
            values[f":t{s}"] = {"S": token}
            sets.append(f"#h{s} = :h{s}, #t{s} = :t{s}")
            if s in tokens:
                values[f":o{s}"] = {"S": tokens[s]}
                conditions.append(f"#t{s} = :o{s}")
            else:
                conditions.append(f"attribute_not_exists(#t{s})")
            tokens[s] = token
        updates.append(
            {
                "Update": {
                    "TableName": "t",
                    "Key": {"pk": {"S": f"block#{b:05d}"}, "sk": {"S": "head"}},
                    "UpdateExpression": "SET " + ", ".join(sets),
                    "ConditionExpression": " AND ".join(conditions),
                    "ExpressionAttributeNames": names,
                    "ExpressionAttributeValues": values,
                }
            }
        )
    for lo in range(0, len(updates), 100):
        ddb.transact_write_items(TransactItems=updates[lo : lo + 100])


def measure(variant: str, batches: int) -> float:
    """CPU seconds per batch of 256 heads (after 3 unmeasured ones), in this process."""
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    for name in list(os.environ):
        if name.startswith("AWS_ENDPOINT_URL"):
            del os.environ[name]
    import boto3
    from moto import mock_aws

    layout, block, fixed = _VARIANTS[variant]
    if fixed:
        from shardless.processor.local import moto_server

        moto_server._patch()
    with mock_aws():
        ddb = boto3.client("dynamodb")
        _table(ddb)
        state: dict[int, Any] = {}
        for i in range(3 + batches):
            if i == 3:
                started = time.process_time()
            if layout == "per_slice":
                _per_slice_batch(ddb, state, i + 1)
            else:
                _block_batch(ddb, state, block)
        return (time.process_time() - started) / batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of every variant")
    parser.add_argument("--batches", type=int, default=5, help="measured batches per run")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--variant", choices=sorted(_VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:  # one measurement, in a process of its own
        print(json.dumps(measure(args.variant, args.batches)))
        return 0
    runs: dict[str, list[float]] = {v: [] for v in _VARIANTS}
    for _ in range(args.rounds):
        for variant in _VARIANTS:
            out = subprocess.run(
                [sys.executable, "-m", "bench.head_items", "--variant", variant,
                 "--batches", str(args.batches)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {v: statistics.median(x) for v, x in runs.items()}
    base = median["per_slice"]
    result = {
        "config": {"slices": SLICES, "head_bytes": HEAD_BYTES, "rounds": args.rounds,
                   "batches_per_run": args.batches,
                   "measure": "CPU seconds per batch of 256 heads, client and in-process moto"},
        "cpu_s_per_batch": {v: round(m, 4) for v, m in median.items()},
        "runs": {v: [round(x, 4) for x in xs] for v, xs in runs.items()},
        "ratio_to_per_slice": {v: round(m / base, 2) for v, m in median.items()},
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for v, m in median.items():
            print(f"{v:28s} {m:.3f} CPU-s per batch  ({m / base:.2f} x per_slice)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
