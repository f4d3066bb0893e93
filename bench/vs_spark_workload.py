"""The workloads of `bench.vs_spark`: each written once as Parquet files of one micro-batch
each, in the order Spark's file source reads them, with what every batch must produce (a
NumPy fold of the same keys)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.state_loop import key_ids

WORKLOADS = {  # name: (distribution, distinct keys)
    "uniform_1m": ("uniform", 1_000_000),
    "zipf_1m": ("zipf", 1_000_000),
    "small_1k": ("uniform", 1_000),
}
SOURCE_SCHEMA = "partition_key string, sequence_number long, arrival timestamp, data binary"
PAYLOAD = b'{"v":1}'
START = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class Workload:
    """A workload's files (one per micro-batch) and what each batch must produce."""

    name: str
    root: Path
    files: list[Path]
    sizes: list[int]
    distinct: list[int]  # distinct keys per batch: Spark's operators emit one row each
    totals: list[int]  # the sum of those keys' counts after the batch
    counts: np.ndarray  # every key's count after the last batch

    def prefix(self, batches: int) -> Path:
        """A folder with the first `batches` files (hard links), for the slow contenders."""
        folder = self.root / f"first-{batches}"
        if not folder.exists():
            folder.mkdir()
            for f in self.files[:batches]:
                os.link(f, folder / f.name)
        return folder


def build(
    name: str, dist: str, keys: int, records: int, size: int, seed: int, root: Path
) -> Workload:
    """Write the workload's batches as Parquet files and fold their expected counts."""
    ids = np.asarray(key_ids(dist, records, keys, seed), dtype=np.int64)
    names = np.array([f"user-{i}" for i in range(keys)], dtype=object)
    folder = root / name / "all"
    folder.mkdir(parents=True)
    counts = np.zeros(keys, dtype=np.int64)
    w = Workload(name, root / name, [], [], [], [], counts)
    for b, lo in enumerate(range(0, records, size)):
        chunk = ids[lo : lo + size]
        np.add.at(counts, chunk, 1)
        seen = np.unique(chunk)
        arrival = [START.timestamp() * 1e6 + (lo + i) * 1000 for i in range(len(chunk))]
        table = pa.table(
            {
                "partition_key": pa.array(names[chunk], pa.string()),
                "sequence_number": pa.array(np.arange(lo, lo + len(chunk)), pa.int64()),
                "arrival": pa.array(np.array(arrival, dtype="int64"), pa.timestamp("us", "UTC")),
                "data": pa.array([PAYLOAD] * len(chunk), pa.binary()),
            }
        )
        path = folder / f"batch-{b:05d}.parquet"
        pq.write_table(table, path)
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))  # the file source's order
        w.files.append(path)
        w.sizes.append(len(chunk))
        w.distinct.append(len(seen))
        w.totals.append(int(counts[seen].sum()))
    return w
