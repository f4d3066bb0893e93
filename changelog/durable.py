"""Read and commit an application's durable state: S3 segments and DynamoDB slice heads.

A Spark task commits all the slices it changed in a batch with one S3 PUT and one
DynamoDB transaction per 100 slices; slices without changes cost nothing. Each head is
written whole (PutItem) on condition that the stored head is still exactly the one the
task started from (its log and epoch: `head_condition`), so a stale, zombie or
speculative attempt cannot commit over another, and its segment is never referenced.

Ownership: a commit by a process that does not own a slice takes it over in the same
write (the epoch goes up by one, `owner` names the process); `claim` does the same without
a commit, for tools. Either fences every earlier owner.

Queries: each commit transaction also checks that its query is not fenced
(`shardless.changelog.fence`), so a query that another one took over, or that was rolled back
behind, cannot land a commit even on heads it read after the takeover. Each transaction carries a
`ClientRequestToken` derived from the segment's uid, so an SDK retry of a transaction that did land
(its answer lost) succeeds instead of failing its own condition.
"""

from __future__ import annotations

import math
import os
import random
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from shardless.changelog import aws, fence, segment_cache
from shardless.changelog.chain_reads import resolve_heads
from shardless.changelog.chain_writes import seal
from shardless.changelog.commits import CommitResult, SliceCommit, Upload
from shardless.changelog.errors import (
    CommitTooLateError,
    CorruptObjectError,
    MissingObjectError,
    ThrottledError,
)
from shardless.changelog.history import next_history
from shardless.changelog.layout import (
    CLAIM_READ,
    HEAD_SK,
    AppLocation,
    Claim,
    Head,
    LogEntry,
    claim_from_item,
    encode_log,
    head_condition,
    head_from_item,
    head_item,
    new_uid,
    query_tag,
    segment_key,
    slice_of_pk,
    slice_pk,
)
from shardless.changelog.objects import get_bytes, missing
from shardless.changelog.segment import SectionRef, decode_section, encode_segment
from shardless.changelog.transactions import (
    NOT_LOST,
    Guard,
    GuardFailedError,
    HeadConflictError,
    cancellation_reasons,
    combined_failure,
    item_bytes,
    lost_message,
    request_token,
    transaction_chunks,
)
from shardless.changelog.transfer_process import TRANSFER_PROCESS_BYTES
from shardless.state.store import Change

_CONFLICT_ATTEMPTS = 4  # a transaction cancelled only by another one in flight is retried
# a transaction cancelled because DynamoDB throttled one of its items is retried after a
# jittered, growing pause, this many times, then reported as throttled (not as lost)
_THROTTLED_ATTEMPTS = 8
_SEAL_ROUNDS = 8  # heads read again that name yet another chain: seal that one too
# A group of more than 100 changed slices commits in several transactions, sent at once
# (at most this many together): its commit waits about one round trip instead of one each.
TRANSACTION_THREADS = 8
_HEADS_PER_READ = 100  # DynamoDB's limit of keys per BatchGetItem
# A read of more than 100 heads (a group's first batch on a host, a tool over every slice)
# sends its BatchGetItem calls at once, at most this many together.
READ_THREADS = 8
# A BatchGetItem answer may leave keys unprocessed (a throttled table answers part of a
# request); they are asked for again after a jittered, growing pause, this many rounds.
UNPROCESSED_ROUNDS = 10
UNPROCESSED_PAUSE_S = 0.05  # the first pause is up to this long, then doubling, at most 2 s
# A commit refuses to reference uploads (its segment, the batch's snapshots) older than
# this: gc beside a running job deletes unreferenced objects only past a grace at least
# twice as long (`shardless.changelog.gc.RUNNING_GRACE_S`), so a stalled task cannot commit a
# reference to an object gc has removed.
COMMIT_DEADLINE_S = 1200.0


def section_range(entry: LogEntry) -> str:
    """The HTTP byte range of `entry`'s section in its segment object."""
    return f"bytes={entry.offset}-{entry.offset + entry.length - 1}"


def owner_name() -> str:
    """Who this process is, as recorded in the heads of the slices it owns."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _unprocessed_pause_s(attempt: int) -> float:
    """The pause before asking again for keys a BatchGetItem left unprocessed: full jitter
    up to UNPROCESSED_PAUSE_S, doubling with each `attempt` (1, 2, ...), at most 2 s."""
    return random.uniform(0, min(2.0, UNPROCESSED_PAUSE_S * 2 ** (attempt - 1)))


class DurableState:
    """An application's durable state. With `segment_cache`, a directory on local disk,
    committed segments are also kept there (`segment_cache`), and
    `read_changes` reads from it first: another worker process of the same host that
    catches up a slice then reads no S3."""

    def __init__(
        self,
        loc: AppLocation,
        keep_snapshots: int = 3,
        segment_cache: Path | None = None,
        transfer_process_bytes: int | None = TRANSFER_PROCESS_BYTES,
    ) -> None:
        self.loc = loc
        self.keep_snapshots = keep_snapshots
        self.segment_cache = segment_cache
        # a restore fetching at least this many bytes of snapshots runs its transfers in the
        # worker's helper process (`shardless.changelog.transfer_process`); None: never
        self.transfer_process_bytes = transfer_process_bytes

    @property
    def _s3(self):  # noqa: ANN202
        return aws.client("s3")

    @property
    def _ddb(self):  # noqa: ANN202
        return aws.client("dynamodb")

    @property
    def _commit_ddb(self):  # noqa: ANN202
        """For the transactions of head items, built here from typed heads."""
        return aws.client("dynamodb", validated=False)

    def heads(self, slices: list[int]) -> dict[int, Head]:
        """Committed heads of `slices` (absent when a slice was never committed); a head
        that names a group chain comes back extended through it (`chain_reads`)."""
        return resolve_heads(self.loc, self._batch_read(slices, head_from_item))

    def claims(self, slices: list[int]) -> dict[int, Claim]:
        """The claims of `slices`' head items (`layout.Claim`: who holds each, on which
        chain, with which stored log, none of it decoded): whether a head was written since
        it was read, for the price of a read of the heads without their history."""
        return self._batch_read(slices, claim_from_item, CLAIM_READ)

    def _batch_read(
        self, slices: list[int], convert: Callable[[dict], Any], extra: dict | None = None
    ) -> dict[int, Any]:
        """Head items of `slices` as `convert` makes them: one BatchGetItem per 100 slices,
        sent together (up to `READ_THREADS`)."""
        chunks = [slices[i : i + _HEADS_PER_READ] for i in range(0, len(slices), _HEADS_PER_READ)]
        found: dict[int, Any] = {}
        if len(chunks) <= 1 or READ_THREADS <= 1:
            for chunk in chunks:
                found.update(self._read_heads(chunk, convert, extra or {}))
            return found
        with ThreadPoolExecutor(min(len(chunks), READ_THREADS), "shardless-heads") as pool:
            futures = [pool.submit(self._read_heads, c, convert, extra or {}) for c in chunks]
        for future in futures:  # every read has ended; the first failure is raised
            found.update(future.result())
        return found

    def _read_heads(
        self, slices: list[int], convert: Callable[[dict], Any], extra: dict
    ) -> dict[int, Any]:
        """One BatchGetItem of up to 100 heads, asking again for what it leaves unprocessed."""
        keys = [{"pk": {"S": slice_pk(s)}, "sk": {"S": HEAD_SK}} for s in slices]
        request = {self.loc.table: {"Keys": keys, "ConsistentRead": True, **extra}}
        found: dict[int, Any] = {}
        for attempt in range(UNPROCESSED_ROUNDS):
            if attempt:
                time.sleep(_unprocessed_pause_s(attempt))
            out = self._ddb.batch_get_item(RequestItems=request)
            for item in out["Responses"].get(self.loc.table, []):
                found[slice_of_pk(item["pk"]["S"])] = convert(item)
            request = out.get("UnprocessedKeys") or {}
            if not request:
                return found
        left = sorted(slice_of_pk(k["pk"]["S"]) for k in request[self.loc.table]["Keys"])
        raise ThrottledError(
            f"DynamoDB table {self.loc.table} ({aws.where('dynamodb')}) still left the heads of "
            f"slices {left} unprocessed after {UNPROCESSED_ROUNDS} BatchGetItem rounds: its "
            "read capacity is exhausted; raise it (or its on-demand maximum), then run again"
        )

    def cached(self, entry: LogEntry) -> bool:
        """Whether `entry`'s segment is in the host's segment cache (it may still turn out
        damaged: `read_changes` then reads S3)."""
        cache = self.segment_cache
        return cache is not None and segment_cache.path(cache, entry.uid).is_file()

    def read_changes(self, slice_id: int, entry: LogEntry) -> list[Change]:
        """Fetch and verify one slice's section of a segment by byte range (from the local
        segment cache when it has the segment)."""
        if self.segment_cache is not None:
            local = segment_cache.path(self.segment_cache, entry.uid)
            try:
                raw = segment_cache.read_range(
                    self.segment_cache, entry.uid, entry.offset, entry.length
                )
                return decode_section(
                    raw,
                    slice_id=slice_id,
                    version=entry.version,
                    where=f"{local} ({self.section_where(slice_id, entry)})",
                )
            except (OSError, CorruptObjectError):
                pass  # not here (or damaged): S3 has it
        try:
            raw = get_bytes(self.loc.bucket, entry.key(self.loc), section_range(entry))
        except MissingObjectError as exc:
            raise missing(self.section_where(slice_id, entry)) from exc
        return self.decode_changes(slice_id, entry, raw)

    def section_where(self, slice_id: int, entry: LogEntry) -> str:
        return f"s3://{self.loc.bucket}/{entry.key(self.loc)} (slice {slice_id} v{entry.version})"

    def decode_changes(self, slice_id: int, entry: LogEntry, raw: bytes) -> list[Change]:
        """Verify and decode a section fetched from S3 by `section_range`."""
        where = self.section_where(slice_id, entry)
        return decode_section(raw, slice_id=slice_id, version=entry.version, where=where)

    def commit(
        self,
        query: str,
        batch: int,
        group: int,
        commits: list[SliceCommit],
        owner: str | None = None,
        uploads_since: float | None = None,
    ) -> CommitResult:
        """Persist the changes of several slices; return the segment's uid, the heads as
        written and the cost. `uploads_since` (time.monotonic()) is when the batch's first
        upload that the commit references began (its snapshots); the commit refuses to go
        out past `COMMIT_DEADLINE_S` from then, and DynamoDB refuses it once garbage
        collection's horizon has passed that time (CommitTooLateError both).

        The segment is written first; the DynamoDB transaction then makes it part of the
        slices' committed history. If the transaction loses, the segment stays unreferenced.
        With `owner`, slices that another owner (or none) held are taken over in the same
        write.
        """
        if not commits:
            return CommitResult("", 0, 0)
        self.off_chains({c.slice: c.expected for c in commits}, owner or owner_name())
        up = self.upload(query, batch, group, commits, uploads_since)
        now = _now_ms()
        heads: dict[int, Head] = {}
        items = []
        for c, ref in zip(commits, up.refs, strict=True):
            new = self.next_head(c, ref, query, batch, group, up.uid, now)
            new = replace(new, log_bytes=encode_log(new.log), chain="", chain_from=0)
            if owner is not None and new.owner != owner:
                new = replace(new, epoch=new.epoch + 1, owner=owner, claimed_ms=now)
            heads[c.slice] = new
            items.append(
                {"Put": {"TableName": self.loc.table, "Item": head_item(new),
                         **head_condition(c.expected)}}
            )  # fmt: skip
        slices = [c.slice for c in commits]
        what = f"batch {batch}: commit of slices"
        done = self.transact(items, slices, what, up.uid, query, up.deadline, up.since_ms)
        return CommitResult(up.uid, len(up.body), done, heads, up.took())

    def upload(
        self,
        query: str,
        batch: int,
        group: int,
        commits: list[SliceCommit],
        uploads_since: float | None,
    ) -> Upload:
        """Encode and PUT a commit's segment (kept in the host's cache too)."""
        started = time.perf_counter()
        uid = new_uid()
        info = {"app": self.loc.app, "query": query, "batch": batch, "group": group}
        body, refs = encode_segment(info, [(c.slice, c.version, c.changes) for c in commits])
        encoded = time.perf_counter()
        first_upload = min(time.monotonic(), uploads_since or math.inf)
        since_ms = _now_ms() - math.ceil((time.monotonic() - first_upload) * 1000)
        self._s3.put_object(
            Bucket=self.loc.bucket, Key=segment_key(self.loc, batch, group, uid), Body=body
        )
        if self.segment_cache is not None:
            segment_cache.keep(self.segment_cache, uid, body)
        return Upload(uid, body, refs, first_upload + COMMIT_DEADLINE_S, since_ms,
                       started, encoded, time.perf_counter())  # fmt: skip

    def next_head(
        self, c: SliceCommit, ref: SectionRef, query: str, batch: int, group: int, uid: str,
        now: int,
    ) -> Head:  # fmt: skip
        """The slice's head once `c` is committed in segment `uid` at `ref`."""
        entry = LogEntry(c.version, batch, group, uid, ref.offset, ref.length, ref.records,
                         query_tag(query))  # fmt: skip
        old = c.expected or Head(c.slice, 0, "", -1)
        log, snaps = next_history(old.log, old.snaps, entry, c.snapshot, self.keep_snapshots)
        return replace(
            old, version=c.version, query=query, batch=batch, log=log, snaps=snaps, at_ms=now,
            next_timer=c.timers[0], next_event_timer=c.timers[1],
        )  # fmt: skip

    def transact(
        self,
        items: list[dict],
        slices: list[int],
        what: str,
        uid: str,
        query: str | None = None,
        deadline: float = math.inf,
        since_ms: int | None = None,
        guards: tuple[Guard, ...] = (),
    ) -> int:
        """Write `items` (one per slice of `slices`) in as few transactions as DynamoDB
        allows, sent at once (up to `TRANSACTION_THREADS`); returns how many. With `query`,
        each transaction also checks that the query is not fenced (and, with `since_ms`,
        that gc's horizon is older than the uploads it references); with `guards`, each
        checks their conditions too. A transaction cancelled because a head changed (or a
        guard failed) raises HeadConflictError naming the slices that lost; one cancelled
        only because another transaction held an item, or because DynamoDB throttled it, is
        retried. The others land or lose on their own: each head's condition is its own."""
        sizes = [item_bytes(next(iter(item.values()))) for item in items]
        chunks = transaction_chunks(sizes, checks=len(guards))

        def send(lo: int, hi: int) -> None:
            self.send(
                items[lo:hi], slices[lo:hi], what, f"{uid}-{lo}", query, deadline, since_ms, guards
            )

        if len(chunks) == 1 or TRANSACTION_THREADS <= 1:
            for lo, hi in chunks:  # one at a time: the first failure stops the rest
                send(lo, hi)
            return len(chunks)
        workers = min(len(chunks), TRANSACTION_THREADS)
        with ThreadPoolExecutor(workers, thread_name_prefix="shardless-commit") as pool:
            futures = [pool.submit(send, lo, hi) for lo, hi in chunks]
        failures = [e for e in (f.exception() for f in futures) if e is not None]
        if failures:
            raise combined_failure(failures, len(chunks), what)
        return len(chunks)

    def send(
        self,
        items: list[dict],
        slices: list[int],
        what: str,
        token: str,
        query: str | None,
        deadline: float = math.inf,
        since_ms: int | None = None,
        guards: tuple[Guard, ...] = (),
    ) -> None:
        """One transaction; retried while it is cancelled only by another in flight or by
        throttling. Raises QueryFencedError when `query` is fenced, CommitTooLateError when
        gc's horizon passed its uploads, ThrottledError when DynamoDB kept throttling it,
        HeadConflictError naming the slices that lost (GuardFailedError, naming all of them,
        when one of `guards` failed)."""
        checks = [g.item for g in guards]
        if query is not None:
            checks.append(fence.check_item(self.loc, query, since_ms))
        sent = items + checks
        conflicts = throttles = 0
        while True:
            tries = conflicts + throttles
            if time.monotonic() > deadline:
                raise CommitTooLateError(
                    f"{what} {slices}: its uploads are more than {COMMIT_DEADLINE_S:.0f} s old "
                    "(a stalled task?); garbage collection beside the running job may have "
                    "removed them, so nothing is committed and the attempt is retried"
                )
            try:
                self._commit_ddb.transact_write_items(
                    TransactItems=sent, ClientRequestToken=request_token(token, tries)
                )
                return
            except ClientError as exc:
                if exc.response["Error"]["Code"] != "TransactionCanceledException":
                    raise
                reasons = cancellation_reasons(exc, len(sent))
                if query is not None and reasons[-1] == "ConditionalCheckFailed":
                    raise fence.refusal(self.loc, query, f"{what} {slices}", since_ms) from exc
                for i, g in enumerate(guards):
                    if reasons[len(items) + i] == "ConditionalCheckFailed":
                        raise GuardFailedError(f"{what} {slices}: {g.failed}", slices) from exc
                heads = reasons[: len(items)]
                lost = [s for s, r in zip(slices, heads, strict=True) if r not in NOT_LOST]
                if not lost and "ThrottlingError" in reasons:
                    throttles += 1
                    if throttles < _THROTTLED_ATTEMPTS:
                        time.sleep(random.uniform(0, min(2.0, 0.05 * 2**throttles)))
                        continue
                    raise ThrottledError(
                        f"{what} {slices}: DynamoDB table {self.loc.table} "
                        f"({aws.where('dynamodb')}) throttled the transaction "
                        f"{_THROTTLED_ATTEMPTS} times: its write capacity is exhausted; raise "
                        "it (or its on-demand maximum); nothing of this transaction landed"
                    ) from exc
                if not lost and "TransactionConflict" in reasons:
                    conflicts += 1
                    if conflicts < _CONFLICT_ATTEMPTS:
                        time.sleep(random.uniform(0.01, 0.05) * 2**conflicts)
                        continue
                lost = lost or slices
                raise HeadConflictError(lost_message(what, lost), lost) from exc

    def claim(self, heads: dict[int, Head | None], owner: str | None = None) -> dict[int, Head]:
        """Take ownership of slices: raise each one's epoch by one, conditional on the head
        read (`None`: never written). Returns the claimed heads; every write based on an
        older head fails from now on. Raises CommitConflictError when another writer
        changed a head in between."""
        owner = owner or owner_name()
        heads = {**heads, **self.off_chains(heads, owner)}
        now = _now_ms()
        claimed: dict[int, Head] = {}
        items = []
        for s, head in sorted(heads.items()):
            old = head or Head(s, 0, "", -1)
            new = replace(old, epoch=old.epoch + 1, owner=owner, claimed_ms=now)
            if old.chain:  # its versions in its own log from now on
                new = replace(new, chain="", chain_from=0, log_bytes=encode_log(old.log))
            claimed[s] = new
            items.append(
                {"Put": {"TableName": self.loc.table, "Item": head_item(new),
                         **head_condition(head)}}
            )  # fmt: skip
        slices = sorted(heads)
        self.transact(items, slices, "claim of slices", new_uid())
        return claimed

    def off_chains(self, heads: dict[int, Head | None], owner: str) -> dict[int, Head]:
        """Before heads read through group chains are written whole (by a per-slice commit
        or a claim): `sealed_again`, and HeadConflictError naming the slices whose chain
        committed a version after they were read (the write was built on them)."""
        named = {s: h for s, h in heads.items() if h is not None and h.chain}
        again = self.sealed_again(named, owner)
        moved = [
            s for s, h in named.items() if (again[s].version, again[s].log) != (h.version, h.log)
        ]
        if moved:
            raise HeadConflictError(lost_message("heads of slices", moved), moved)
        return again

    def sealed_again(
        self, heads: dict[int, Head | None], owner: str, keep: str = ""
    ) -> dict[int, Head]:
        """Seal the chains `heads` name (all but `keep`), so nothing more lands there
        unseen, and read those heads again: their versions are final. A head read again
        may name a chain another writer took it into meanwhile: that one is sealed too,
        and so on until every head read names a sealed chain. HeadConflictError names the
        slices another writer took into `keep` meanwhile."""
        named = [s for s, h in heads.items() if h is not None and h.chain and h.chain != keep]
        if not named:
            return {}
        current: dict[int, Head | None] = dict(heads)
        done: set[str] = set()
        for _ in range(_SEAL_ROUNDS):
            chains = {current[s].chain for s in named} - done  # type: ignore[union-attr]
            if not chains:
                return {s: current[s] for s in named}  # type: ignore[misc]
            for chain in sorted(chains):
                seal(self.loc, chain, owner)
            done |= chains
            current.update(self.heads(named))
            into_keep = [s for s in named if current[s].chain == keep]  # type: ignore[union-attr]
            if into_keep:
                raise HeadConflictError(
                    f"heads of slices {into_keep} were taken into chain {keep} by another "
                    "writer meanwhile; this attempt's output is discarded",
                    into_keep,
                )
        raise HeadConflictError(
            f"heads of slices {sorted(named)} kept moving to other chains while their chains "
            f"were sealed ({_SEAL_ROUNDS} rounds): another writer keeps taking them over",
            named,
        )
