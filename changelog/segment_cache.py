"""The host's cache of committed segments on local disk: the newest `SEGMENT_CACHE_FILES`,
so another worker process of the host that catches a slice up reads no S3. A cache only:
S3 has every segment, and anything missing or unreadable here is read from there."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SEGMENT_CACHE_FILES = 64  # newest segments kept on local disk for other workers of the host


def keep(cache: Path, uid: str, body: bytes) -> None:
    """Keep a committed segment; drop the oldest beyond the limit."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{uid}.tmp"
        tmp.write_bytes(body)
        os.replace(tmp, cache / f"{uid}.seg")
        files = list(cache.glob("*.seg"))
        if len(files) > SEGMENT_CACHE_FILES:
            by_age = sorted(files, key=lambda f: f.stat().st_mtime)
            for f in by_age[: len(files) - SEGMENT_CACHE_FILES]:
                with contextlib.suppress(OSError):
                    f.unlink()
    except OSError:
        pass  # a cache: S3 has every segment


def path(cache: Path, uid: str) -> Path:
    return cache / f"{uid}.seg"


def read_range(cache: Path, uid: str, offset: int, length: int) -> bytes:
    """Bytes of a cached segment; OSError when it is not here."""
    with path(cache, uid).open("rb") as f:
        f.seek(offset)
        return f.read(length)
