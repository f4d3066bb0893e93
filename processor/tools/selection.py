"""Which slices, at which versions, a state command or the state data source reads."""

from __future__ import annotations

from shardless.changelog import rollback
from shardless.changelog.inspect import StateQueryError
from shardless.changelog.layout import AppLocation, Head, query_tag


def parse_slices(spec: str | None, slices: int) -> list[int]:
    """`"3"`, `"0-15"`, `"1,4,9-12"` (None: every slice) as sorted slice ids."""
    if spec is None:
        return list(range(slices))
    out: set[int] = set()
    for part in spec.split(","):
        try:
            lo, _, hi = part.strip().partition("-")
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise StateQueryError(
                f"--slice {spec!r}: use slice numbers and ranges like 3, 0-15 or 1,4,9-12"
            ) from None
        if not 0 <= a <= b < slices:
            raise StateQueryError(
                f"--slice {spec!r}: {part.strip()} is outside the application's slices "
                f"0..{slices - 1}"
            )
        out.update(range(a, b + 1))
    return sorted(out)


def latest_query(heads: dict[int, Head]) -> str:
    committed = [h for h in heads.values() if h.committed and h.query]
    if not committed:
        raise StateQueryError("the application has no committed state")
    return max(committed, key=lambda h: h.at_ms).query


def targets(
    heads: dict[int, Head],
    wanted: list[int],
    *,
    version: int | None = None,
    batch: int | None = None,
    query: str | None = None,
    loc: AppLocation | None = None,
) -> dict[int, int]:
    """The version to read of each wanted slice: the head's, `version` (one slice only),
    or every slice as it stood after `batch` of `query` (default: the newest query); with
    `loc`, the commits of queries that began on the state after it are cut too."""
    if version is not None and batch is not None:
        raise StateQueryError("give --version (one slice) or --batch (every slice), not both")
    if version is not None:
        if len(wanted) != 1:
            raise StateQueryError(
                "--version is a single slice's version: pass --slice N with it, or --batch B "
                "for a consistent cut of every slice"
            )
        return {wanted[0]: version}
    if batch is None:
        return {s: heads[s].version if s in heads else 0 for s in wanted}
    tag = query_tag(query or latest_query(heads))
    later = rollback.later_tags(loc, tag) if loc is not None else frozenset()
    out = {}
    for s in wanted:
        h = heads.get(s)
        try:
            out[s] = rollback.target(h, tag, batch, later) if h is not None and h.committed else 0
        except rollback.RollbackError as exc:
            raise StateQueryError(str(exc)) from exc
    return out
