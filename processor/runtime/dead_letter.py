"""Where records go that cannot be processed: their bytes, coordinates and the error.

A record whose bytes the configured decoder cannot read, whose handler keeps raising, or
that came later than the watermark (`--on-late dead-letter`), is set aside here (when the
job is configured to) instead of failing the batch. Nothing is dropped silently: every
dead letter holds the record exactly as read (data in base64), its stream, shard, sequence
and sub-sequence numbers, partition key and slice, the stage that failed (`key`,
`event-time`, `late`, `decode` or `handler`), the error and how many attempts were made.

Targets:
  s3://bucket/prefix   one JSON-lines object per (query, batch, group):
                       `<prefix>/<query8>/<batch>/g<group>.jsonl`. A retried batch reads the
                       same records and rewrites the same object, so S3 dead letters are
                       exactly once.
  kinesis://stream     PutRecords, partition key = the record's coordinates; a retried
                       batch may put a letter again (at least once): deduplicate by
                       (stream, shard, sequence_number, subsequence).

Dead letters are written before the batch's state commits: a batch whose letters cannot
be written fails and is retried, so a set-aside record is never lost.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from shardless.changelog import aws
from shardless.processor.errors import ConfigError, ProcessorError
from shardless.processor.kinesis.put import PutRecordsError, Retries, put_records

_ATTEMPTS = 8


class DeadLetterError(ProcessorError):
    """Dead letters could not be written; the batch fails rather than lose them."""


@dataclass(frozen=True)
class DeadLetter:
    stream: str
    shard: str
    sequence_number: str
    subsequence: int
    partition_key: str
    slice: int
    data: bytes
    stage: str  # "key", "event-time", "late", "decode" or "handler"
    error: str  # "ValueError: boom"
    attempts: int
    key: str | None = None  # the app's chosen key, when it has one other than the partition key

    def to_dict(self, query: str, batch: int, group: int) -> dict[str, Any]:
        out = asdict(self)
        out["data"] = base64.b64encode(self.data).decode()
        if self.key is None:
            del out["key"]
        return {**out, "query": query, "batch": batch, "group": group}

    @property
    def coordinates(self) -> str:
        return f"{self.stream}/{self.shard}/{self.sequence_number}/{self.subsequence}"


class Target(Protocol):
    def write(self, query: str, batch: int, group: int, letters: Sequence[DeadLetter]) -> str:
        """Write the letters; return where they went."""
        ...


@dataclass(frozen=True)
class S3Target:
    bucket: str
    prefix: str

    def key(self, query: str, batch: int, group: int) -> str:
        base = self.prefix.strip("/")
        rest = f"{query[:8]}/{batch:012d}/g{group:05d}.jsonl"
        return f"{base}/{rest}" if base else rest

    def write(self, query: str, batch: int, group: int, letters: Sequence[DeadLetter]) -> str:
        key = self.key(query, batch, group)
        body = "".join(
            json.dumps(x.to_dict(query, batch, group), sort_keys=True) + "\n" for x in letters
        ).encode()
        try:
            aws.client("s3").put_object(Bucket=self.bucket, Key=key, Body=body)
        except Exception as exc:
            raise DeadLetterError(
                f"cannot write {len(letters)} dead letters to s3://{self.bucket}/{key}: {exc}"
            ) from exc
        return f"s3://{self.bucket}/{key}"


@dataclass(frozen=True)
class KinesisTarget:
    stream: str

    def write(self, query: str, batch: int, group: int, letters: Sequence[DeadLetter]) -> str:
        kinesis = aws.client("kinesis")
        entries = [
            {
                "PartitionKey": x.coordinates[:256],
                "Data": json.dumps(x.to_dict(query, batch, group), sort_keys=True).encode(),
            }
            for x in letters
        ]
        try:
            put_records(kinesis, self.stream, entries, Retries(attempts=_ATTEMPTS))
        except PutRecordsError as exc:
            raise DeadLetterError(
                f"cannot put {exc.left} dead letters into Kinesis stream {self.stream!r}: {exc}"
            ) from exc
        return f"kinesis://{self.stream}"


def target(spec: str) -> Target:
    """`s3://bucket/prefix` or `kinesis://stream` as a Target."""
    scheme, sep, rest = spec.partition("://")
    if sep and scheme == "s3" and rest:
        bucket, _, prefix = rest.partition("/")
        return S3Target(bucket, prefix)
    if sep and scheme == "kinesis" and rest and "/" not in rest:
        return KinesisTarget(rest)
    raise ConfigError(f"--dead-letter {spec!r}: use s3://bucket/prefix or kinesis://stream-name")
