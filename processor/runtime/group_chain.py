"""A group's part in chain commits (`commit_format="chains"`): which chain it appends to,
taking its slices over into it, and adopting a batch another attempt committed first.

The group's chain is the one this process remembers from its previous batch, else one its
slices' heads name that was started by this query for this group under this group layout
and is not sealed, else a new one. Slices whose heads name another chain (or none) are
taken over before the batch runs, so their versions are counted from the chain's next
position. A chain is append-only: when Spark runs a batch again after its first attempt
committed, the re-run keeps what was committed (its outputs are computed again from the
same state and records) instead of replacing it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from shardless.changelog.chain import SliceRange
from shardless.changelog.chain_commits import take_over
from shardless.changelog.chain_reads import read_genesis
from shardless.changelog.chain_writes import ChainTip, create_chain, find_tip, seal, still_tip
from shardless.changelog.durable import DurableState, SliceCommit
from shardless.changelog.layout import Head, claim_of
from shardless.processor.runtime.config import RuntimeConfig
from shardless.processor.runtime.grouping import slices_of_key
from shardless.state.transaction import Transaction

log = logging.getLogger(__name__)


def group_range(cfg: RuntimeConfig, group: int) -> SliceRange:
    """The slices a group's chain may name: its range under the job's group layout (every
    slice when the runner has no layout, outside Spark)."""
    if cfg.partitions is None:
        return SliceRange(0, cfg.slices)
    own = slices_of_key(group, cfg.slices, cfg.partitions)
    return SliceRange(own.start, own.stop - own.start)


# A chain is rolled over after this many positions, or four per slice of its group when
# that is more: a fresh host then reads a bounded chain, and the takeovers a roll-over costs
# (one head write per slice that changes afterwards) add at most 1/4 of a head write per
# slice and batch (docs/design/group-commits.md).
CHAIN_POSITIONS = 256
POSITIONS_PER_SLICE = 4


def chain_limit(cfg: RuntimeConfig, group: int) -> int:
    """The positions a group's chain takes before the group starts a new one."""
    if cfg.chain_length is not None:
        return cfg.chain_length
    return max(CHAIN_POSITIONS, POSITIONS_PER_SLICE * group_range(cfg, group).count)


def wanted(cfg: RuntimeConfig, group: int, query: str) -> tuple:
    """What a chain's genesis must say for `group` of `query` to append to it."""
    return (query, cfg.partitions or 0, group, group_range(cfg, group), cfg.keep_snapshots)


def find_chain(
    durable: DurableState,
    cfg: RuntimeConfig,
    group: int,
    query: str,
    heads: dict[int, Head | None],
) -> ChainTip:
    """The group's unsealed chain that one of `heads` names (this query's, for this group
    under this layout and snapshot retention), else a new one."""
    mine = wanted(cfg, group, query)
    for chain in sorted({h.chain for h in heads.values() if h is not None and h.chain}):
        g = read_genesis(durable.loc, chain)
        if not g.dead and (g.query, g.partitions, g.group, g.range, g.keep_snapshots) == mine:
            tip = find_tip(durable.loc, g)
            if not tip.sealed:
                return tip
    return create_chain(durable.loc, *mine)


def unchanged_since(durable: DurableState, tip: ChainTip, heads: dict[int, Head | None]) -> bool:
    """Whether nothing was committed to the slices of `heads` after `tip` (what a host knew
    after the last batch it ran the group in): the chain still ends at the tip
    (`still_tip`), and each slice's head item is as it was: absent where it was absent,
    else the same claim (`layout.Claim`) naming this chain. The protocol seals a chain
    before it writes a head that names it, so the first read would do; the second also
    catches a head item written past the protocol (by hand, or a table restored from a
    backup). Two reads, where reading the heads again through the chain costs a Query of
    the chain and a GET of each link's segment index."""
    if any(h is not None and h.chain != tip.chain for h in heads.values()):
        return False
    if not still_tip(durable.loc, tip):
        return False
    claims = durable.claims(sorted(heads))
    return all(claims.get(s) == (None if h is None else claim_of(h)) for s, h in heads.items())


def roll_over(
    durable: DurableState, cfg: RuntimeConfig, group: int, query: str, tip: ChainTip, owner: str
) -> tuple[ChainTip, frozenset[str]]:
    """`tip` when its chain is shorter than `chain_limit`; else the chain sealed and a new
    one started, which the batch's slices are then taken over into (`join`), and the
    group's other slices as they change. Their versions in the old chain stay readable up
    to its seal; once no head names it, gc deletes it.

    Also the chains whose heads are final as the group knows them: the old chain when this
    seal landed right after `tip` (nothing was committed after the tip the heads were read
    or remembered at, and nothing can be now), so its slices need not be read again through
    it (`join`'s `settled`)."""
    if tip.position < chain_limit(cfg, group):
        return tip, frozenset()
    sealed = seal(durable.loc, tip.chain, owner)
    ours = sealed.last is not None and sealed.last.sealed_by == owner
    settled = ours and sealed.position == tip.position + 1
    log.info("group %d: chain %s reached position %d; starting a new one", group, tip.chain,
             tip.position)  # fmt: skip
    new = create_chain(durable.loc, *wanted(cfg, group, query))
    return new, frozenset({tip.chain} if settled else ())


def join(
    durable: DurableState,
    tip: ChainTip,
    heads: dict[int, Head | None],
    slices: list[int],
    owner: str,
    query: str,
    settled: frozenset[str] = frozenset(),
) -> dict[int, Head]:
    """Take over the slices of `slices` that `tip`'s chain does not commit yet; returns
    their heads as written (the others need nothing). Heads naming a `settled` chain are
    final as given (`roll_over`); the takeover's conditions still check that nobody wrote
    them since."""
    take = {s: heads.get(s) for s in slices}
    take = {s: h for s, h in take.items() if h is None or h.chain != tip.chain}
    return take_over(durable, take, tip, owner, query, settled) if take else {}


def adopt(
    durable: DurableState,
    reruns: set[int],
    commits: list[SliceCommit],
    heads: dict[int, Head | None],
    stores: dict[int, Any],
) -> tuple[list[SliceCommit], list[tuple[list, list]], str]:
    """A batch Spark runs again after an attempt of it committed (`reruns`: the slices whose
    newest version that attempt committed, in whichever chain): the commits and undo
    records that apply the committed changes to the local stores (started one version
    back), in place of this run's own, and the committing segment's uid. A slice this run
    changed that the batch's commit did not (a handler whose results depend on more than
    its state and records) keeps its committed version; it is logged."""
    stray = sorted(c.slice for c in commits if c.slice not in reruns)
    if stray:
        log.warning(
            "a batch ran again and changed slices %s that its first commit did not: the "
            "handler is not deterministic; the committed state stays",
            stray,
        )
    out, deltas, uid = [], [], ""
    for c in commits:
        head = heads.get(c.slice)
        if c.slice not in reruns or head is None:
            continue
        entry = next(e for e in head.log if e.version == c.version)
        changes = durable.read_changes(c.slice, entry)
        out.append(replace(c, changes=changes))
        deltas.append((changes, Transaction(stores[c.slice][0]).undo(changes)))
        uid = uid or entry.uid
    return out, deltas, uid
