"""One PutRecords loop for everything shardless puts into Kinesis: the sink, dead letters,
the producer, the fault harness and the benchmarks.

Entries go in calls of at most 500 records and 5 MiB (`chunks`). When Kinesis fails some
entries of a call (throttling, internal failures), only those are put again; when the
whole call fails with a code worth another try (`RETRYABLE`, or a connection error), all
of them are. Tries are spaced by full-jitter exponential backoff, up to `attempts` calls
per chunk; then `PutRecordsError` says how many entries are left and which codes were seen,
and the caller turns it into its own message.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from shardless.processor.errors import ProcessorError

MAX_RECORDS_PER_CALL = 500
MAX_BYTES_PER_CALL = 5 * 1024 * 1024
# Whole-call failures worth another try; anything else (a missing stream, no permission,
# a bad request) fails at once.
RETRYABLE = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "LimitExceededException",
        "ThrottlingException",
        "KMSThrottlingException",
        "InternalFailure",
        "InternalFailureException",
        "ServiceUnavailable",
        "ServiceUnavailableException",
    }
)


class PutRecordsError(ProcessorError):
    """Entries still failing after every attempt, or a call that failed for good."""

    def __init__(self, message: str, left: int, codes: Counter[str], final: bool) -> None:
        super().__init__(message)
        self.left = left  # entries not put
        self.codes = codes  # error code -> entries that failed with it, over all attempts
        self.final = final  # True: a failure no retry can mend (the call's code is not RETRYABLE)


@dataclass(frozen=True)
class Retries:
    """How often and how patiently to put one chunk."""

    attempts: int = 8
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    also_retry: frozenset[str] = frozenset()  # more whole-call codes worth another try

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * 2**attempt))


def chunks(entries: Iterable[dict]) -> Iterator[list[dict]]:
    """Entries in PutRecords-sized lists: at most 500 records and 5 MiB each."""
    chunk: list[dict] = []
    size = 0
    for entry in entries:
        n = len(entry["Data"]) + len(entry["PartitionKey"].encode())
        if chunk and (len(chunk) == MAX_RECORDS_PER_CALL or size + n > MAX_BYTES_PER_CALL):
            yield chunk
            chunk, size = [], 0
        chunk.append(entry)
        size += n
    if chunk:
        yield chunk


def put_chunk(
    kinesis: Any,
    stream: str,
    entries: list[dict],
    retries: Retries = Retries(),  # noqa: B008 - frozen
    sleep: Callable[[float], None] | None = None,
) -> int:
    """PutRecords until every entry of one chunk is in, retrying only the failed ones;
    returns the number of calls made. `sleep` defaults to `time.sleep` at call time."""
    sleep = sleep or time.sleep
    pending = entries
    seen: Counter[str] = Counter()
    for attempt in range(1, retries.attempts + 1):
        try:
            out = kinesis.put_records(StreamName=stream, Records=pending)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = error.get("Code", "Unknown")
            seen[code] += len(pending)
            if code not in RETRYABLE and code not in retries.also_retry:
                raise PutRecordsError(
                    f"{code}: {error.get('Message')}", len(pending), seen, final=True
                ) from exc
        except BotoCoreError as exc:  # connection refused, reset, timed out
            seen[type(exc).__name__] += len(pending)
        else:
            results = out["Records"]
            failed = [e for e, r in zip(pending, results, strict=True) if "ErrorCode" in r]
            seen.update(r["ErrorCode"] for r in results if "ErrorCode" in r)
            if not failed:
                return attempt
            pending = failed
        if attempt < retries.attempts:
            sleep(retries.delay(attempt))
    codes = ", ".join(f"{code} x{n}" for code, n in seen.most_common())
    raise PutRecordsError(
        f"{len(pending)} of {len(entries)} records still failing after {retries.attempts} "
        f"attempts (failures: {codes})",
        len(pending),
        seen,
        final=False,
    )


def put_records(
    kinesis: Any,
    stream: str,
    entries: Iterable[dict],
    retries: Retries = Retries(),  # noqa: B008 - frozen
    sleep: Callable[[float], None] | None = None,
) -> int:
    """Put every entry, chunk by chunk (`put_chunk`); returns the number of calls made."""
    return sum(put_chunk(kinesis, stream, c, retries, sleep) for c in chunks(entries))
