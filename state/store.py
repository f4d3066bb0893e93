"""A slice's local RocksDB store: point reads, ordered scans, and atomic versioned commits.

The store is a cache of durable state. Its version marker is written in the same
WriteBatch as the data it describes, so after any crash the store is at some committed
version, never between two.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgpack
from rocksdict import BlockBasedOptions, Checkpoint, Options, Rdict, ReadOptions, WriteBatch

from shardless.state.errors import CorruptStoreError
from shardless.state.keys import (
    DATA,
    DATA_END,
    IDENTITY_KEY,
    TAG_KEY,
    UNDO_KEY,
    USER_START,
    VERSION_KEY,
)

Change = tuple[bytes, bytes | None]


def store_options() -> Options:
    """The RocksDB options of every slice store."""
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    # A slice store holds a few SST files. RocksDB's default opens them on up to 16 new
    # threads, created and joined on every open: most of an open's CPU for a small store.
    opts.set_max_file_opening_threads(1)
    # A batch reads each of its keys once (`Transaction.prefetch`), and on a large key space
    # most are not there yet. Without filters every miss searches the memtable and every
    # SST file a snapshot's flush left; a Bloom filter per SST (10 bits a key, about 1%
    # false positives) and one over the memtable (MEMTABLE_BLOOM_RATIO of its budget)
    # answer most of them without looking (bench/results/store_reads.json).
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    opts.set_memtable_prefix_bloom_ratio(MEMTABLE_BLOOM_RATIO)
    opts.set_memtable_whole_key_filtering(True)
    return opts


# Of the memtable's 64 MiB budget: 67 KiB a store, 10 bits a key for its first ~54,000
# keys (17 MiB for 256 slices' stores); RocksDB caps the ratio at 0.25.
MEMTABLE_BLOOM_RATIO = 0.001


class SliceStore:
    """One slice's RocksDB store, opened for exclusive use by this process."""

    def __init__(self, path: Path, identity: dict[str, object]) -> None:
        self.path = Path(path)
        self.identity = dict(identity)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = Rdict(str(self.path), store_options())
        except Exception as exc:
            raise CorruptStoreError(f"cannot open local store {self.path}: {exc}") from exc
        found = self._db.get(IDENTITY_KEY)
        if found is None:
            self._db.put(IDENTITY_KEY, msgpack.packb(self.identity))
        elif msgpack.unpackb(found) != self.identity:
            self._db.close()
            raise CorruptStoreError(
                f"local store {self.path} belongs to {msgpack.unpackb(found)!r}, "
                f"expected {self.identity!r}; it will be discarded and rebuilt"
            )

    @property
    def version(self) -> int:
        raw = self._db.get(VERSION_KEY)
        return 0 if raw is None else int(msgpack.unpackb(raw))

    @property
    def tag(self) -> str:
        """Which commit of `version` this store holds ("" when unknown)."""
        raw = self._db.get(TAG_KEY)
        return "" if raw is None else str(msgpack.unpackb(raw))

    def get(self, key: bytes) -> bytes | None:
        return self._db.get(key)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return self._db.get(keys) if keys else []

    def items(self, lo: bytes = DATA, hi: bytes | None = DATA_END) -> Iterator[tuple[bytes, bytes]]:
        """Entries with `lo <= key < hi` in key order (user values by default; `hi=None`
        for no upper bound)."""
        ro = ReadOptions()
        if hi is not None:
            ro.set_iterate_upper_bound(hi)
        yield from self._db.items(from_key=lo, read_opt=ro)

    def user_items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every entry but engine metadata: values, map entries, timers, expiries."""
        return self.items(USER_START, None)

    def commit(
        self,
        changes: Iterable[Change],
        version: int,
        undo: list[Change] | None = None,
        tag: str = "",
    ) -> None:
        """Apply `changes` and set the version marker (and `tag`, naming the durable commit
        of that version) in one atomic write.

        With `undo` (the values the changes overwrite), the store can later roll this one
        commit back without reading anything durable.
        """
        wb = WriteBatch(raw_mode=True)
        for key, value in changes:
            if value is None:
                wb.delete(key)
            else:
                wb.put(key, value)
        wb.put(VERSION_KEY, msgpack.packb(version))
        wb.put(TAG_KEY, msgpack.packb(tag))
        if undo is None:
            wb.delete(UNDO_KEY)
        else:
            wb.put(UNDO_KEY, msgpack.packb([version, undo, self.tag]))  # tuples pack as arrays
        self._db.write(wb)

    def roll_back(self) -> bool:
        """Undo the last commit if its undo record is here; False when it is not."""
        raw = self._db.get(UNDO_KEY)
        if raw is None:
            return False
        version, undo, *rest = msgpack.unpackb(raw)
        if version != self.version:
            return False
        changes = [(bytes(k), None if v is None else bytes(v)) for k, v in undo]
        self.commit(changes, version - 1, tag=rest[0] if rest else "")
        return True

    def flush_soon(self) -> None:
        """Start writing the memtable to an SST file on RocksDB's own thread, and return.

        A checkpoint flushes the memtable first and waits for it, most of a slice's checkpoint
        (`docs/benchmarks.md`, "Measurements behind the code"). Called when the slice's next batch
        will take a snapshot, the flush
        runs while the process waits for that batch, outside the GIL."""
        self._db.flush(False)

    def checkpoint(self, dest: Path) -> Path:
        """A consistent copy of the store in the new directory `dest` (hard links to the
        immutable SST files, after flushing the memtable)."""
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Checkpoint(self._db).create_checkpoint(str(dest))
        return Path(dest)

    def exists_on_disk(self) -> bool:
        """False when someone removed the directory under an open handle."""
        return (self.path / "CURRENT").exists()

    def close(self) -> None:
        # Closing a store whose files were removed fails; the handle is dropped either way.
        with contextlib.suppress(Exception):
            self._db.close()

    @staticmethod
    def destroy(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)
