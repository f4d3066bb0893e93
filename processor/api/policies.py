"""What a job does with records it cannot process: the decoder, and the policies for a
record the decoder cannot read and for a handler that raises.

  on_decode_error   fail         the batch fails, naming the record's coordinates (default)
                    dead-letter  the record goes to the dead-letter target; the handler
                                 never sees it
                    raw          the handler sees it with `event.value` = the bytes and
                                 `event.decode_error` = why
  on_handler_error  fail         the batch fails, naming the record (default)
                    dead-letter  the record's writes and outputs are undone and it goes to
                                 the dead-letter target with the error
  handler_retries   N            a record whose handler raises is run again up to N times
                                 (its writes and outputs undone before each attempt) before
                                 `on_handler_error` applies
  on_late           process      a record at or before the watermark runs like any other
                                 (default); with an event time named by the app or
                                 `--event-time-field` (`shardless.processor.api.event_time`)
                    drop         it is counted and logged, and the handler never sees it
                    dead-letter  it goes to the dead-letter target (stage `late`)

A record without a readable event time goes where `on_decode_error` says.

Nothing is dropped silently: every record set aside is logged with its coordinates,
counted in the batch's metrics (`dead_letters`) and written to the target before the
batch's state commits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardless.processor.api.decoders import DECODERS, ON_DECODE_ERROR, decoder
from shardless.processor.api.event_time import LATE_POLICIES
from shardless.processor.errors import ConfigError

ON_HANDLER_ERROR = ("fail", "dead-letter")
MAX_HANDLER_RETRIES = 100


@dataclass(frozen=True)
class RecordPolicy:
    decoder: str = "raw"
    on_decode_error: str = "fail"
    on_handler_error: str = "fail"
    handler_retries: int = 0
    on_late: str = "process"
    # whether the records carry an event time read from them (the job sets it when the app
    # or `--event-time-field` names one): only then are records judged late
    event_time: bool = False

    def __post_init__(self) -> None:
        if self.decoder not in DECODERS:
            raise ConfigError(f"--decoder {self.decoder!r}: use one of {', '.join(DECODERS)}")
        if self.on_decode_error not in ON_DECODE_ERROR:
            raise ConfigError(
                f"--on-decode-error {self.on_decode_error!r}: use fail (default), dead-letter "
                "or raw"
            )
        if self.on_handler_error not in ON_HANDLER_ERROR:
            raise ConfigError(
                f"--on-handler-error {self.on_handler_error!r}: use fail (default) or dead-letter"
            )
        if self.on_late not in LATE_POLICIES:
            raise ConfigError(
                f"--on-late {self.on_late!r}: use process (default), drop or dead-letter"
            )
        retries = self.handler_retries
        if isinstance(retries, bool) or not isinstance(retries, int):
            raise ConfigError(f"--handler-retries {retries!r}: must be an integer")
        if not 0 <= retries <= MAX_HANDLER_RETRIES:
            raise ConfigError(
                f"--handler-retries {retries}: must be between 0 and {MAX_HANDLER_RETRIES}"
            )

    @property
    def decode(self) -> Callable[[bytes], Any] | None:
        """The decode function, or None when records pass as bytes (`raw`)."""
        return None if self.decoder == "raw" else decoder(self.decoder)

    @property
    def guarded(self) -> bool:
        """Whether a failing handler is caught (retried or set aside) rather than fatal."""
        return self.handler_retries > 0 or self.on_handler_error != "fail"

    @property
    def sets_aside(self) -> bool:
        """Whether any record may go to the dead-letter target."""
        return "dead-letter" in (self.on_decode_error, self.on_handler_error, self.on_late)
