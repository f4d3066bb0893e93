"""Writing an application's state out as Parquet or JSON lines.

Each slice is materialised from S3 at its chosen version in a scratch directory, read in
key order and written out: Parquet as one file per slice (`part-<slice>.parquet`, readable
as one dataset by Spark, pandas or DuckDB), JSON lines as one file, slices in order.
Values are JSON text (bytes as `{"base64": ...}`), since a slice may hold any shape.
Pickled values only with `allow_pickle` (trusted buckets only: unpickling runs code).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from shardless.changelog.durable import DurableState
from shardless.changelog.inspect import Entry, entries, opened
from shardless.changelog.layout import Head

FORMATS = ("parquet", "jsonl")
SCHEMA = pa.schema(
    [
        ("slice", pa.int32()),
        ("key", pa.string()),
        ("sub", pa.string()),
        ("value", pa.string()),
        ("version", pa.int64()),
    ]
)


@dataclass
class ExportReport:
    format: str
    path: str
    slices: int = 0
    rows: int = 0
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def rows_of(
    durable: DurableState,
    head: Head | None,
    slices: int,
    slice_id: int,
    version: int | None,
    allow_pickle: bool = False,
) -> list[Entry]:
    with opened(durable, head, slices, version) as store:
        return list(entries(store, slice_id, allow_pickle=allow_pickle))


def _table(rows: list[Entry]) -> pa.Table:
    return pa.table(
        {
            "slice": [e.slice for e in rows],
            "key": [e.key for e in rows],
            "sub": [e.sub for e in rows],
            "value": [json.dumps(e.to_dict()["value"]) for e in rows],
            "version": [e.version for e in rows],
        },
        schema=SCHEMA,
    )


def export(
    durable: DurableState,
    heads: dict[int, Head],
    slices: int,
    targets: dict[int, int],
    fmt: str,
    out: Path,
    *,
    threads: int = 4,
    on_slice: Callable[[int, int], None] = lambda rows, nbytes: None,
    allow_pickle: bool = False,
) -> ExportReport:
    """Export the slices of `targets` (slice -> version) to `out` (a directory for Parquet,
    a file for JSON lines)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: use one of {', '.join(FORMATS)}")
    report = ExportReport(fmt, str(out))
    order = sorted(targets)

    def one(s: int) -> list[Entry]:
        return rows_of(durable, heads.get(s), slices, s, targets[s], allow_pickle)

    if fmt == "parquet":
        out.mkdir(parents=True, exist_ok=True)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results: Iterator[list[Entry]] = pool.map(one, order)
        if fmt == "parquet":
            for s, rows in zip(order, results, strict=True):
                path = out / f"part-{s:05d}.parquet"
                pq.write_table(_table(rows), path)
                size = path.stat().st_size
                report.slices += 1
                report.rows += len(rows)
                report.bytes += size
                on_slice(len(rows), size)
        else:
            with out.open("w", encoding="utf-8") as f:
                for rows in results:
                    size = 0
                    for e in rows:
                        line = json.dumps(e.to_dict(), sort_keys=True) + "\n"
                        f.write(line)
                        size += len(line)
                    report.slices += 1
                    report.rows += len(rows)
                    report.bytes += size
                    on_slice(len(rows), size)
    return report
