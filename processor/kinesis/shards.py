"""Shard discovery and lineage: which shards may be read, and in what order.

A child shard is read only after every parent has been read to its end, so per key the
parent's records come before the child's. `depth` orders shards along lineage: a record
from a deeper shard of the same key always comes later in the stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from shardless.processor.errors import SourceError


@dataclass(frozen=True)
class Shard:
    stream: str
    shard_id: str
    parents: tuple[str, ...]
    starting_hash_key: str
    ending_hash_key: str
    closed: bool

    @property
    def key(self) -> str:
        return f"{self.stream}/{self.shard_id}"


def list_shards(kinesis, stream: str) -> list[Shard]:  # noqa: ANN001 - boto3 client
    """All shards of a stream that Kinesis still lists (open and closed)."""
    shards: list[Shard] = []
    kwargs: dict = {"StreamName": stream}
    while True:
        try:
            out = kinesis.list_shards(**kwargs)
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "ResourceNotFoundException":
                raise SourceError(
                    f"Kinesis stream {stream!r} does not exist at this endpoint: create it, or "
                    f"fix the stream name / AWS_ENDPOINT_URL_KINESIS / region"
                ) from exc
            raise
        for s in out["Shards"]:
            parents = tuple(
                p for p in (s.get("ParentShardId"), s.get("AdjacentParentShardId")) if p
            )
            shards.append(
                Shard(
                    stream=stream,
                    shard_id=s["ShardId"],
                    parents=parents,
                    starting_hash_key=s["HashKeyRange"]["StartingHashKey"],
                    ending_hash_key=s["HashKeyRange"]["EndingHashKey"],
                    closed="EndingSequenceNumber" in s["SequenceNumberRange"],
                )
            )
        token = out.get("NextToken")
        if not token:
            return shards
        kwargs = {"NextToken": token}


def depths(shards: list[Shard]) -> dict[str, int]:
    """Lineage depth per shard key: 0 for shards whose parents are gone, else parent + 1."""
    by_id = {(s.stream, s.shard_id): s for s in shards}
    memo: dict[tuple[str, str], int] = {}

    def depth(ident: tuple[str, str]) -> int:
        if ident not in memo:
            shard = by_id[ident]
            known = [(shard.stream, p) for p in shard.parents if (shard.stream, p) in by_id]
            memo[ident] = 1 + max(map(depth, known)) if known else 0
        return memo[ident]

    return {f"{s}/{i}": depth((s, i)) for (s, i) in by_id}


def readable(shards: list[Shard], done: set[str]) -> list[Shard]:
    """Shards not yet read to their end whose listed parents all have been."""
    listed = {s.key for s in shards}
    out = []
    for s in shards:
        if s.key in done:
            continue
        parents = [f"{s.stream}/{p}" for p in s.parents]
        if all(p in done or p not in listed for p in parents):
            out.append(s)
    return out


def vanished(shards: list[Shard], stream: str, positions: dict[str, dict]) -> list[str]:
    """Shards of `stream` the source was part-way through that Kinesis no longer lists.

    Kinesis drops a closed shard from its listing once its records are past the stream's
    retention, so whatever the source had not read of it yet has expired unread.
    """
    listed = {s.key for s in shards}
    prefix = f"{stream}/"
    return sorted(
        key
        for key, position in positions.items()
        if key.startswith(prefix) and not position.get("done") and key not in listed
    )


def stream_records(kinesis, stream: str) -> Iterator[dict[str, Any]]:  # noqa: ANN001
    """Every record of `stream` as boto3 returns it, shard by shard from TRIM_HORIZON, each
    shard's records in order: a plain read for checks and tools (reference folds), not the
    source (no lineage order, no pacing, no positions)."""
    for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
        it = kinesis.get_shard_iterator(
            StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while it:
            out = kinesis.get_records(ShardIterator=it, Limit=10_000)
            yield from out["Records"]
            it = out.get("NextShardIterator") if out["Records"] else None
