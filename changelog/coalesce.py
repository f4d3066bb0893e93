"""Which changelog sections a restore reads together. A segment holds one section per slice
its batch changed, so restoring a group's slices on a new host asks each segment object for
many sections; read one by one that is a ranged GET per slice and segment (2,112 for 128
slices 16 segments behind). Sections of one object that lie close together are read as one
span instead, like Arrow's read-range coalescing: a hole of at most `HOLE_BYTES` between two
of them is read and thrown away, a span stops at `SPAN_BYTES`, and the spans of one restore
hold at most `BUDGET_BYTES` (each is kept in memory until its last section is applied).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HOLE_BYTES = 64 << 10  # a gap between two sections read rather than paid as another GET
SPAN_BYTES = 8 << 20  # the longest span
BUDGET_BYTES = 64 << 20  # every span of a restore together; sections past it are read alone

Section = tuple[str, int, int]  # (object key, offset, length)


@dataclass(frozen=True)
class Span:
    """A byte range of one object, read with one GET for the sections inside it."""

    key: str
    start: int
    end: int  # exclusive

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def byte_range(self) -> str:
        return f"bytes={self.start}-{self.end - 1}"

    def cut(self, blob: bytes, offset: int, length: int) -> bytes:
        """The section at `offset` (in the object) out of the span's bytes."""
        at = offset - self.start
        return blob[at : at + length]


def coalesce(
    sections: Sequence[Section | None],
    hole: int = HOLE_BYTES,
    longest: int = SPAN_BYTES,
    budget: int = BUDGET_BYTES,
) -> list[Span | None]:
    """For each section, in order, the span it is read with; None: read alone (it has no
    neighbour close enough, or the budget is spent; a None section stays None). Spans are
    granted in the order their first section is needed."""
    by_key: dict[str, list[int]] = {}
    for i, s in enumerate(sections):
        if s is not None:
            by_key.setdefault(s[0], []).append(i)
    runs: list[tuple[list[int], Span]] = []
    for key, members in by_key.items():
        members.sort(key=lambda i: sections[i][1])  # type: ignore[index]
        run: list[int] = []
        start = end = 0
        for i in members:
            _, offset, length = sections[i]  # type: ignore[misc]
            if run and offset - end <= hole and max(end, offset + length) - start <= longest:
                run.append(i)
                end = max(end, offset + length)
                continue
            if len(run) > 1:
                runs.append((run, Span(key, start, end)))
            run, start, end = [i], offset, offset + length
        if len(run) > 1:
            runs.append((run, Span(key, start, end)))
    out: list[Span | None] = [None] * len(sections)
    spent = 0
    for run, span in sorted(runs, key=lambda r: min(r[0])):
        if spent + span.length > budget:
            continue
        spent += span.length
        for i in run:
            out[i] = span
    return out
