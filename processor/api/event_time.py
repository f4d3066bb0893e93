"""Event time from the record, when it is not the Kinesis arrival time.

An app names its event time as a JSON field path of the record (`event_time = "ts"` in
the app file, or `shardless run --event-time-field ts`) or as a function
(`def event_time(record) -> int | datetime`). Without either, event time is the record's
arrival time, as it always was, at no cost per record.

A field holds epoch milliseconds (a JSON integer, or a number with no fraction) or an ISO
8601 time as a string (`2026-11-26T07:30:00.250Z`; without an offset it is UTC). A function
returns epoch milliseconds or a `datetime` (naive: UTC). The job reads the event time once
per record before the shuffle (`shardless.processor.driver.event_time`), and Spark's
watermark follows it: the largest event time seen in earlier batches minus
`--allowed-lateness-ms`. A record whose event time is at or before the batch's watermark is
late (as Spark and Flink define it); `--on-late` says what happens to it:

  process      the handler sees it like any other record (default; as before)
  drop         the handler never sees it; it is logged and counted
  dead-letter  it goes to the dead-letter target (stage `late`) with its event time

Late records are counted in each batch's metrics (`late_records`) whatever the policy. A
record without a readable event time (no such field, not a time, a function that raises)
goes where `--on-decode-error` says: the batch fails naming the record and the field, it is
set aside (stage `event-time`), or (`raw`) the handler sees it with `event.decode_error`
set and its arrival time as event time; such a record never moves the watermark.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from shardless.processor.api.keys import JSON_WHITESPACE, NOT_JSON, NOT_OBJECT, check_path
from shardless.processor.errors import AppError, ConfigError

__all__ = [
    "LATE_POLICIES",
    "EventTimeChoice",
    "is_late",
    "json_event_time",
    "to_epoch_ms",
]

LATE_POLICIES = ("process", "drop", "dead-letter")
# The times Spark can hand Python (pandas' nanosecond timestamps), as epoch milliseconds.
MIN_MS = -9_223_372_036_854
MAX_MS = 9_223_372_036_854
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def is_late(event_ms: int, watermark_ms: int) -> bool:
    """Whether a record at `event_ms` is later than the watermark: at or before it, once
    there is one (-1: none yet)."""
    return watermark_ms >= 0 and event_ms <= watermark_ms


def _in_range(ms: int, what: str) -> tuple[int | None, str | None]:
    if MIN_MS <= ms <= MAX_MS:
        return ms, None
    return None, f"{what} is {str(ms)[:24]} ms, outside 1677-09-22 to 2262-04-11"


def to_epoch_ms(value: Any, what: str) -> tuple[int | None, str | None]:
    """`value` (epoch ms, an ISO 8601 string or a datetime) as epoch ms, or None and why
    not; `what` names it in the reason ("its field 'ts'")."""
    if isinstance(value, bool) or value is None:
        return None, f"{what} is {json.dumps(value)}, not a time"
    if isinstance(value, int):
        return _in_range(value, what)
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None, f"{what} is {value!r}, not whole epoch milliseconds"
        if not MIN_MS <= value <= MAX_MS:
            return None, f"{what} is {value!r} ms, outside 1677-09-22 to 2262-04-11"
        return _in_range(int(value), what)
    if isinstance(value, datetime):
        at = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return _in_range((at - _EPOCH) // _MS, what)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return None, f"{what} is {value[:60]!r}, not an ISO 8601 time"
        return to_epoch_ms(parsed, what)
    return None, f"{what} is a {type(value).__name__}, not a time"


def json_event_time(data: bytes | None, path: str) -> tuple[int | None, str | None]:
    """The event time at `path` in the record's JSON data (epoch ms), or None and why."""
    try:
        text = data.decode("utf-8")  # type: ignore[union-attr]
    except (AttributeError, UnicodeError):
        return None, NOT_JSON
    if not text.lstrip(JSON_WHITESPACE).startswith("{"):
        return None, NOT_OBJECT
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None, NOT_JSON
    for name in check_path(path):
        if not isinstance(value, dict) or name not in value:
            return None, f"it has no field {path!r}"
        value = value[name]
    return to_epoch_ms(value, f"its field {path!r}")


@dataclass(frozen=True)
class EventTimeChoice:
    """How an app names its event time: a JSON field path, or a function of the record (an
    `Event` whose `key` is its partition key) returning epoch ms or a datetime."""

    field: str | None = None
    function: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if (self.field is None) == (self.function is None):
            raise ConfigError("event time is named by a field path or by a function, one of them")
        if self.field is not None:
            try:
                check_path(self.field)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("key field", "event-time field")) from exc

    @staticmethod
    def of_app(value: Any, where: str) -> EventTimeChoice | None:
        """An app file's `event_time`: a field path (str) or a function; None when unset."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                return EventTimeChoice(field=value)
            except ConfigError as exc:
                raise AppError(f"{where}: {exc}") from exc
        if callable(value):
            return EventTimeChoice(function=value)
        raise AppError(
            f"{where}: event_time must be a JSON field path such as 'ts' or a function "
            f"event_time(record) -> epoch ms or datetime, not {type(value).__name__}"
        )

    def describe(self) -> str:
        """How the event time is named, as error messages name it."""
        if self.field is not None:
            return f"event-time field {self.field!r}"
        return f"event-time function {getattr(self.function, '__name__', 'event_time')}()"

    def of(self, record: Any) -> tuple[int | None, str | None]:
        """The record's event time (epoch ms), or None and why it has none."""
        if self.field is not None:
            return json_event_time(record.data, self.field)
        try:
            found = self.function(record)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - the record's problem, under the record policy
            return None, f"{self.describe()} raised {type(exc).__name__}: {exc}"
        return to_epoch_ms(found, f"what {self.describe()} returned")
