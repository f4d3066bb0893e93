"""Rolling an application's state back to what it was after an earlier batch.

All slices move together to the cut "everything query Q committed up to batch B": a
slice's target is the version before its first commit by Q in a batch after B (slices
with no such commit stay where they are). Heads are rewritten conditionally on the head
read, so a running job makes the roll-back fail rather than interleave with it; the
objects of the versions rolled back stay until garbage collection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from botocore.exceptions import ClientError

from shardless.changelog import aws, fence, resources
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import ChangelogError, CommitConflictError
from shardless.changelog.history import plan_restore
from shardless.changelog.layout import (
    HEAD_SK,
    TIMERS_UNKNOWN,
    AppLocation,
    Head,
    encode_log,
    encode_snaps,
    head_condition,
    query_tag,
    slice_pk,
)


class RollbackError(ChangelogError):
    """The state cannot be rolled back to the batch asked for."""


@dataclass
class RollbackPlan:
    query: str
    batch: int
    moves: dict[int, tuple[int, int]] = field(default_factory=dict)  # slice -> (from, to)

    def to_dict(self) -> dict[str, object]:
        return {
            "query": self.query,
            "batch": self.batch,
            "slices": len(self.moves),
            "moves": {str(s): {"from": a, "to": b} for s, (a, b) in sorted(self.moves.items())},
        }


def target(head: Head, tag: str, batch: int, later: frozenset[str] = frozenset()) -> int:
    """The version of `head` after query `tag`'s batch `batch` (see module docstring).

    The slice's retained history (log entries and snapshots, which record the query and
    batch that committed their version) says where the cut falls: just before the first
    version `tag` committed in a later batch or a query of `later` (the tags of the queries
    that began on the state after `tag`) committed, or, when there is none, at the last
    version `tag` committed (commits after it roll back too). A slice whose retained
    history holds nothing of `tag` or of `later` stays where it is. Raises RollbackError
    when the cut falls before what is retained.
    """
    hist = sorted(
        {(e.version, e.query, e.batch) for e in head.log}
        | {(x.version, x.query, x.batch) for x in head.snaps if x.query}
    )
    too_new = [v for v, q, b in hist if (q == tag and b > batch) or q in later]
    mine = [v for v, q, b in hist if q == tag]
    if too_new:
        version = min(too_new) - 1
    elif mine:
        version = max(mine)
    else:
        return head.version
    if version in (0, head.version):
        return version
    try:
        plan_restore(head, None, version)
    except ValueError:
        kept = f"v{head.snaps[0].version}" if head.snaps else f"v{head.log[0].version - 1}"
        raise RollbackError(
            f"slice {head.slice}: the state after batch {batch} (v{version}) is no longer "
            f"retained (the oldest restorable version is {kept}; keep more with "
            "--keep-snapshots)"
        ) from None
    return version


def later_tags(loc: AppLocation, tag: str) -> frozenset[str]:
    """The tags of the queries that began on the state after query `tag` (its lineage);
    empty when the lineage does not hold `tag`."""
    tags = [query_tag(q) for q in fence.lineage(loc)]
    return frozenset(tags[tags.index(tag) + 1 :]) - {tag} if tag in tags else frozenset()


def plan(loc: AppLocation, query: str, batch: int) -> RollbackPlan:
    slices = resources.app_slices(loc)
    tag = query_tag(query)
    later = later_tags(loc, tag)
    heads = DurableState(loc).heads(list(range(slices)))
    out = RollbackPlan(query, batch)
    for s, head in sorted(heads.items()):
        if not head.committed:
            continue
        to = target(head, tag, batch, later)
        if to != head.version:
            out.moves[s] = (head.version, to)
    return out


def apply(loc: AppLocation, rollback: RollbackPlan) -> int:
    """Rewrite the heads of the plan; returns how many moved. Each head is conditional on
    the version the plan saw.

    First, the plan's query and every query whose commits move back are fenced
    (`shardless.changelog.fence`): their checkpoints are past the point the state now stands at, so
    restarted (or still running) they must not commit on top of the rolled-back heads."""
    durable = DurableState(loc)
    heads = durable.heads(sorted(rollback.moves))
    fence.fence(loc, {rollback.query, *(heads[s].query for s in rollback.moves if s in heads)})
    try:  # heads read through group chains: nothing more may land there
        heads = {**heads, **durable.off_chains(dict(heads), "rollback")}
    except CommitConflictError as exc:
        raise CommitConflictError(
            f"{exc}: is the application running? Stop it and plan again"
        ) from exc
    ddb = aws.client("dynamodb")
    moved = 0
    for s, (was, to) in sorted(rollback.moves.items()):
        head = heads[s]
        if head.version != was:
            raise CommitConflictError(
                f"slice {s} moved from v{was} to v{head.version} since the plan was made: is "
                "the application running? Stop it and plan again"
            )
        log = tuple(e for e in head.log if e.version <= to)
        snaps = tuple(x for x in head.snaps if x.version <= to)
        at = next((e for e in log if e.version == to), None)
        batch = at.batch if at else (snaps[-1].batch if snaps and snaps[-1].version == to else -1)
        # conditional on the head exactly as read (its stored log and epoch)
        condition = head_condition(head)
        try:
            ddb.update_item(
                TableName=loc.table,
                Key={"pk": {"S": slice_pk(s)}, "sk": {"S": HEAD_SK}},
                # the timers of the version rolled back to are not known here: a new
                # checkpoint wakes the slice to look (TIMERS_UNKNOWN); its versions are all
                # in its own log now (no chain)
                UpdateExpression="SET #v = :v, #q = :q, #b = :b, #l = :log, #s = :s, "
                "#e = :next, #o = :owner, #tp = :unknown REMOVE #te, #ch, #from",
                ConditionExpression=condition["ConditionExpression"],
                ExpressionAttributeNames={
                    **condition["ExpressionAttributeNames"],
                    "#v": "version",
                    "#q": "query",
                    "#b": "batch",
                    "#l": "log",
                    "#s": "snaps",
                    "#e": "epoch",
                    "#o": "owner",
                    "#tp": "tp",
                    "#te": "te",
                    "#ch": "ch",
                    "#from": "from",
                },
                ExpressionAttributeValues={
                    **condition.get("ExpressionAttributeValues", {}),
                    ":v": {"N": str(to)},
                    ":q": {"S": f"rollback:{rollback.query}"},
                    ":b": {"N": str(batch)},
                    ":log": {"B": encode_log(log)},
                    ":s": {"B": encode_snaps(snaps)},
                    ":next": {"N": str(head.epoch + 1)},  # fences every current owner
                    ":owner": {"S": "rollback"},
                    ":unknown": {"N": str(TIMERS_UNKNOWN)},
                },
            )
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "ConditionalCheckFailedException":
                raise CommitConflictError(
                    f"slice {s} changed while rolling back ({moved} slices already moved): "
                    "stop the application and run the roll-back again"
                ) from exc
            raise
        moved += 1
    return moved
