"""Moving changelog objects: the process's transfer pool (`file_pool`), an object's bytes
(`get_bytes`), and the MissingObjectError naming an object that committed state refers to
but the bucket no longer has. `OnBytes` is what a transfer tells of each chunk it moves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from botocore.exceptions import ClientError

from shardless.changelog import aws
from shardless.changelog.errors import MissingObjectError

FILE_THREADS = 16

OnBytes = Callable[[int], None]


def no_progress(n: int) -> None:
    pass


pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def file_pool() -> ThreadPoolExecutor:
    """The process's pool for object transfers (separate from per-slice restore threads)."""
    global _pool
    with pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="shardless-io")
        return _pool


def missing(where: str) -> MissingObjectError:
    return MissingObjectError(
        f"{where} is referenced by committed state but missing from the bucket: it was "
        "deleted outside shardless (or by a garbage collection with too short a grace "
        "period); recover it from S3 versioning, or roll the application back to a "
        "version that does not need it"
    )


def is_missing(exc: ClientError) -> bool:
    return exc.response["Error"]["Code"] in {"NoSuchKey", "404", "NotFound"}


def get_bytes(bucket: str, key: str, byte_range: str | None = None) -> bytes:
    """An object's bytes (`byte_range` as in HTTP: "bytes=0-99"); a missing object raises
    MissingObjectError."""
    extra = {"Range": byte_range} if byte_range else {}
    try:
        return aws.client("s3").get_object(Bucket=bucket, Key=key, **extra)["Body"].read()
    except ClientError as exc:
        if is_missing(exc):
            raise missing(f"s3://{bucket}/{key}") from exc
        raise
