"""The slice heads a worker knows without asking DynamoDB, and its groups' chain tips.

Spark runs each partition (a group of slices) once per batch, so the worker that ran a
group in batch b-1 knows every head of its slices as they stand when batch b starts: its
own commits and the heads it read. It keeps them in memory, and in a hint file per group
on the host (`<base>/<app>/hints/g<group>.msgpack`) for another worker process of the host
that gets the group next. Commits are conditional on the exact head they start from, so a
head that is stale anyway (a zombie, a speculative attempt, a tool) costs a conflict and a
run with heads read afresh, never a wrong commit. What a worker knew after an older batch
(the group was idle since, or ran elsewhere) is only used once DynamoDB vouches for it
(`stale`, `vouch`; `shardless.processor.runtime.group_chain.unchanged_since`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import msgpack

from shardless.changelog.chain import genesis_from_item, genesis_item, link_from_item, link_item
from shardless.changelog.chain_writes import ChainTip
from shardless.changelog.layout import Head, decode_log, head_from_item, head_item
from shardless.changelog.log_encoder import LogEncoder

log = logging.getLogger(__name__)


class KnownHeads:
    """What one process knows of its groups' heads and chain tips, and the host's hints."""

    def __init__(self, hints: Path, pid: int) -> None:
        self._hints = hints
        self.pid = pid
        # slice -> (its head, and the query and batch after which it was current)
        self._heads: dict[int, tuple[Head | None, str, int]] = {}
        self._groups: dict[int, set[int]] = {}  # group -> the slices seen in it
        self._tips: dict[int, tuple[ChainTip, str, int]] = {}  # group -> its chain, query, batch
        # group -> its hint file's (inode, size, mtime) when last written or read here, and
        # what it held: a hint unchanged since is not decoded again (128 heads' logs take
        # 10-25 ms a batch)
        self._hints_seen: dict[int, tuple[tuple[int, int, int], Hint]] = {}
        # slice -> the encoder of its log in hints: a batch changes a log only at its ends,
        # so each hint encodes what changed, not every log whole (`log_encoder`)
        self._encoders: dict[int, LogEncoder] = {}

    def heads(
        self, group: int, query: str, batch: int, slices: Iterable[int]
    ) -> dict[int, Head | None]:
        """The heads of `slices` (None: never written) current when `batch` of `query`
        starts, as far as this host knows without DynamoDB: this process's own, or those
        in the group's hint file, when current after the batch before (or after this one:
        Spark runs it again). Slices left out must be read."""
        fresh = ((query, batch - 1), (query, batch))
        hint = self._read_hint(group)
        if hint is not None and (hint[0], hint[1]) in fresh:
            tip = hint[3]
            mine_tip = self._tips.get(group)
            if tip is not None and (
                mine_tip is None or mine_tip[2] < hint[1] or (mine_tip[1], mine_tip[2]) not in fresh
            ):
                self._tips[group] = (tip, hint[0], hint[1])  # fmt: skip
            for s, head in hint[2].items():
                mine = self._heads.get(s)
                if mine is None or (mine[1], mine[2]) not in fresh or mine[2] < hint[1]:
                    self._heads[s] = (head, hint[0], hint[1])
            self._groups.setdefault(group, set()).update(hint[2])
        out: dict[int, Head | None] = {}
        for s in slices:
            found = self._heads.get(s)
            if found is not None and (found[1], found[2]) in fresh:
                out[s] = found[0]
        return out

    def remember(self, group: int, query: str, batch: int, heads: dict[int, Head | None]) -> None:
        """After `batch` of `group` committed: `heads` (those it used or wrote) are current,
        and so are the group's other slices that were current after the batch before
        (nobody else ran the group in between). Written to the group's hint file too."""
        seen = self._groups.setdefault(group, set())
        seen.update(heads)
        current: dict[int, Head | None] = {}
        for s in seen:
            found = self._heads.get(s)
            if s in heads:
                current[s] = heads[s]
            elif found is not None and (found[1], found[2]) in ((query, batch - 1), (query, batch)):
                current[s] = found[0]
        for s, head in current.items():
            self._heads[s] = (head, query, batch)
        self._write_hint(group, query, batch, current)

    def stale(
        self, group: int, query: str, batch: int
    ) -> tuple[ChainTip, dict[int, Head | None]] | None:
        """What this host knew of `group` after the last batch of `query` it ran the group in
        (this process, or another of the host through the group's hint file), when that
        batch is older than the one before `batch` (the group was idle since, or ran
        elsewhere): the group's chain then and its slices' heads then; None otherwise, at
        the cost of a dictionary lookup and a stat. Not current by itself: `vouch` makes it
        so once DynamoDB shows nothing changed since."""
        mine = self._tips.get(group)
        mine_batch = mine[2] if mine is not None and mine[1] == query else -1
        hint = self._read_hint(group)
        if hint is not None and hint[0] == query and hint[3] is not None and hint[1] > mine_batch:
            return (hint[3], hint[2]) if 0 <= hint[1] < batch - 1 else None
        if mine is None or not 0 <= mine_batch < batch - 1:
            return None
        then = (query, mine_batch)
        heads = {}
        for s in self._groups.get(group, ()):
            entry = self._heads.get(s)
            if entry is not None and (entry[1], entry[2]) == then:
                heads[s] = entry[0]
        return mine[0], heads

    def vouch(
        self, group: int, query: str, batch: int, tip: ChainTip, heads: dict[int, Head | None]
    ) -> None:
        """`tip` and `heads`, checked against DynamoDB as `batch` starts, are current as
        after the batch before."""
        self._tips[group] = (tip, query, batch - 1)
        for s, head in heads.items():
            self._heads[s] = (head, query, batch - 1)
        self._groups.setdefault(group, set()).update(heads)

    def tip(self, group: int, query: str, batch: int) -> ChainTip | None:
        """The group's chain as this process left it after the batch before (or this one:
        Spark runs it again); None: find it through the heads."""
        found = self._tips.get(group)
        if found is not None and (found[1], found[2]) in ((query, batch - 1), (query, batch)):
            return found[0]
        return None

    def remember_tip(self, group: int, query: str, batch: int, tip: ChainTip) -> None:
        self._tips[group] = (tip, query, batch)

    def forget(self, group: int) -> None:
        """A run of `group` failed, perhaps half-committed: read its heads afresh next time."""
        self._tips.pop(group, None)
        for s in self._groups.get(group, ()):
            self._heads.pop(s, None)
        with contextlib.suppress(OSError):
            (self._hints / f"g{group}.msgpack").unlink()

    def clear(self) -> None:
        self._tips.clear()
        self._heads.clear()
        self._groups.clear()
        self._hints_seen.clear()
        self._encoders.clear()

    def _write_hint(
        self, group: int, query: str, batch: int, heads: dict[int, Head | None]
    ) -> None:
        # a head read through its chain: its log as read, beside the stored one it is
        # conditional on (`head_item` writes the stored one); other heads hold one log
        items = {s: self._hint_item(s, h) for s, h in heads.items()}
        tip = self._tips.get(group)
        chain = (
            _tip_item(tip[0]) if tip is not None and (tip[1], tip[2]) == (query, batch) else None
        )
        body = msgpack.packb([query, batch, items, chain], use_bin_type=True)
        path = self._hints / f"g{group}.msgpack"
        self._hints_seen.pop(group, None)
        try:
            self._hints.mkdir(parents=True, exist_ok=True)
            tmp = self._hints / f".g{group}.{self.pid}.tmp"
            tmp.write_bytes(body)
            os.replace(tmp, path)
            written = (query, batch, dict(heads), tip[0] if chain is not None else None)
            self._hints_seen[group] = (_file_key(path.stat()), written)  # type: ignore[index]
        except OSError as exc:
            log.debug("group %s: no hint written: %s", group, exc)

    def _hint_item(self, slice_id: int, head: Head | None) -> dict | list | None:
        if head is None:
            return None
        if not head.chain:
            return head_item(head)
        encoder = self._encoders.get(slice_id)
        if encoder is None:
            encoder = self._encoders[slice_id] = LogEncoder()
        return [head_item(head), encoder.encode(head.log)]

    def _read_hint(self, group: int) -> Hint | None:
        path = self._hints / f"g{group}.msgpack"
        try:
            key = _file_key(path.stat())
            seen = self._hints_seen.get(group)
            if seen is not None and seen[0] == key:
                return seen[1]
            raw = path.read_bytes()
            query, batch, items, *rest = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            heads = {int(s): _hint_head(i) for s, i in items.items()}
            tip = _tip_from_item(rest[0]) if rest and rest[0] is not None else None
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - a damaged hint only costs a read
            log.warning("group %s: ignoring unreadable hint: %s", group, exc)
            return None
        hint = (str(query), int(batch), heads, tip)
        self._hints_seen[group] = (key, hint)
        return hint


# a group's hint: the query and batch after which its heads and chain tip were current
Hint = tuple[str, int, dict[int, "Head | None"], "ChainTip | None"]


def _file_key(st: os.stat_result) -> tuple[int, int, int]:
    """A hint file's identity: each write is a new file (`os.replace`)."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _hint_head(item: dict | list | None) -> Head | None:
    if item is None:
        return None
    if isinstance(item, list):
        return replace(head_from_item(item[0]), log=decode_log(item[1]))
    return head_from_item(item)


def _tip_item(tip: ChainTip) -> list:
    """A group's chain tip as the hint keeps it, for the host's other workers."""
    within = tip.genesis.range
    last = None if tip.last is None else link_item(tip.chain, tip.last, within)
    return [genesis_item(tip.genesis), tip.position, last]


def _tip_from_item(item: list) -> ChainTip:
    genesis = genesis_from_item(item[0])
    last = None if item[2] is None else link_from_item(item[2], genesis.range)
    return ChainTip(genesis, int(item[1]), last)
