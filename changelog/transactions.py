"""DynamoDB transactions of head items: how many go in one, what each send is named, and
why one was cancelled, in words.

DynamoDB takes at most 100 items and 4 MB in one TransactWriteItems; a commit sends 99
heads and its query's fence check per transaction. A cancellation names a reason per item
(`CancellationReasons`): a head that changed lost to another writer; one held by another
transaction in flight, or throttled, did not.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from shardless.changelog.errors import CommitConflictError

# DynamoDB's limit of items per transaction is 100: 99 heads and the query's fence check
_SLICES_PER_TRANSACTION = 99
_TRANSACTION_BYTES = 3_500_000  # and its limit of 4 MB per transaction, with room to spare


class HeadConflictError(CommitConflictError):
    """A head was not the one the writer started from; `slices` are the ones that lost."""

    def __init__(self, message: str, slices: list[int]) -> None:
        super().__init__(message)
        self.slices = slices


class GuardFailedError(HeadConflictError):
    """A condition check a write carried besides its heads' (a `Guard`) failed: every
    slice of the transaction lost."""


@dataclass(frozen=True)
class Guard:
    """A condition check every transaction of a write carries besides the heads' own
    (`item`: a TransactWriteItems ConditionCheck), and what its failure means, in words."""

    item: dict[str, Any]
    failed: str


def item_bytes(item: dict[str, Any]) -> int:
    """Roughly what a transaction item counts towards DynamoDB's 4 MB limit."""
    total = 0
    for part in (item.get("Item", {}), item.get("ExpressionAttributeValues", {})):
        for name, value in part.items():
            (raw,) = value.values()
            total += len(name) + len(raw)
    return total


def cancellation_reasons(exc: ClientError, n: int) -> list[str]:
    """Why each item of a cancelled transaction failed ("None": it did not)."""
    found = [r.get("Code") or "None" for r in exc.response.get("CancellationReasons") or []]
    return found if len(found) == n else ["Unknown"] * n


def transaction_chunks(sizes: list[int], checks: int = 0) -> list[tuple[int, int]]:
    """Split items of `sizes` bytes, in order, into the [lo, hi) ranges of as few DynamoDB
    transactions as its limits allow (100 items, 4 MB with room to spare), leaving room in
    each for `checks` more condition checks besides the fence check."""
    chunks: list[tuple[int, int]] = []
    lo, size = 0, 0
    per = _SLICES_PER_TRANSACTION - checks
    for i, n in enumerate(sizes):
        if i > lo and (i - lo == per or size + n > _TRANSACTION_BYTES):
            chunks.append((lo, i))
            lo, size = i, 0
        size += n
    chunks.append((lo, len(sizes)))
    return chunks


def request_token(name: str, attempt: int) -> str:
    """The ClientRequestToken of one send of a transaction: the same for the SDK's own
    retries of that send (an answer lost after the write landed then returns success),
    different for each of our attempts after a cancellation."""
    return hashlib.sha256(f"{name}/{attempt}".encode()).hexdigest()[:36]


# cancellation reasons of a head item that did not lose it to another writer
NOT_LOST = frozenset({"None", "TransactionConflict", "ThrottlingError"})


def lost_message(what: str, lost: list[int]) -> str:
    return (
        f"{what} {lost} lost to another writer (a retried, speculative, zombie or newer "
        "attempt, or a new owner); this attempt's output is discarded"
    )


def combined_failure(failures: list[BaseException], sent: int, what: str) -> BaseException:
    """What a commit whose transactions went out together raises when some failed: an
    error other than a lost head first (it says more), else one HeadConflictError naming
    every slice that lost. The transactions that did not fail have landed."""
    lost = sorted(s for e in failures if isinstance(e, HeadConflictError) for s in e.slices)
    landed = f"{sent - len(failures)} of its {sent} transactions landed"
    other = next((e for e in failures if not isinstance(e, HeadConflictError)), None)
    if other is not None:
        also = f"; slices {lost} lost to another writer" if lost else ""
        other.add_note(f"{what}: {landed}{also}")
        return other
    merged = HeadConflictError(f"{lost_message(what, lost)} ({landed})", lost)
    merged.__cause__ = failures[0].__cause__
    return merged
