"""What a commit carries and what it returns: a slice's change of one batch, the uploaded
segment a commit's DynamoDB write names, and the commit's result (split from `durable`,
which writes them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardless.changelog.chain_writes import ChainTip
from shardless.changelog.layout import Head, SnapRef
from shardless.changelog.segment import SectionRef
from shardless.state.store import Change


@dataclass(frozen=True)
class SliceCommit:
    """What one slice commits in a batch: its new version, based on `expected` (the head
    the writer read or claimed), and a snapshot of the version before, if one was taken."""

    slice: int
    version: int
    expected: Head | None
    changes: list[Change]
    snapshot: SnapRef | None = None
    # when the slice's next processing-time and event-time timers are due after this
    # version (None: none); the head keeps them as the durable index of pending timers
    timers: tuple[int | None, int | None] = (None, None)


@dataclass(frozen=True)
class Upload:
    """A commit's segment, uploaded: what its DynamoDB write names and may take."""

    uid: str
    body: bytes
    refs: list[SectionRef]
    deadline: float  # time.monotonic() past which the commit must not go out
    since_ms: int  # when its first upload began, on the wall clock (gc's horizon check)
    started: float
    encoded: float
    stored: float

    def took(self) -> dict[str, float]:
        return {
            "encode": self.encoded - self.started,
            "s3": self.stored - self.encoded,
            "dynamodb": time.perf_counter() - self.stored,
        }


@dataclass(frozen=True)
class CommitResult:
    """The segment a commit wrote (its uid tags the local stores), the heads as written,
    and what it cost (`seconds` per step: encode, s3, dynamodb)."""

    uid: str
    bytes: int
    transactions: int
    heads: dict[int, Head] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    tip: ChainTip | None = None  # the group's chain after a `commit_link`
