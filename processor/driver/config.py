"""A job's configuration, in one typed place, with defaults that work locally."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

from shardless.changelog.errors import ConfigurationError
from shardless.changelog.layout import AppLocation, check_app_name
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.errors import ConfigError
from shardless.processor.kinesis.positions import check_starting
from shardless.processor.kinesis.reader import CORRUPT_POLICIES as ON_CORRUPT_AGGREGATE
from shardless.processor.kinesis.reader import POLICIES as ON_TRIMMED
from shardless.processor.runtime.dead_letter import target
from shardless.processor.runtime.local_dirs import default_local_dir, private_dir, user_cache_dir
from shardless.processor.runtime.owner import check_supported
from shardless.state.slices import DEFAULT_SLICES, check_slices


@dataclass(frozen=True)
class JobConfig:
    """Everything a shardless job needs besides the handler.

    app:        the application's name; it owns an S3 prefix and a DynamoDB table.
    streams:    Kinesis streams to read.
    slices:     hash slices of the application's state (fixed for the life of its state).
    groups:     Spark shuffle partitions; each runs a contiguous run of slices.
    checkpoint: Spark's checkpoint directory for this query.
    local_dir:  where executors keep slice stores (a cache; losing it costs only time);
                default `$SHARDLESS_LOCAL_DIR`, else the user's `~/.cache/shardless`
                (made 0o700). A directory owned by another user or writable by others is
                refused.
    starting_position: TRIM_HORIZON, LATEST, AT_TIMESTAMP:<time>, or COMMITTED (where the
                application's committed state left off; for a new checkpoint).
    allow_recount: let a new checkpoint at its own starting position run on an application
                whose state already holds records of its streams (they count again);
                refused otherwise.
    on_trimmed: fail | oldest: a source position older than the stream's retention.
    on_corrupt_aggregate: fail | skip: a KPL aggregate that does not decode.
    kinesis_endpoint: a Kinesis endpoint URL for this job's source (default: boto3's own).
    decoder:    raw | utf8 | json: what `event.value` holds (`shardless.processor.api.policies`).
    on_decode_error: fail | dead-letter | raw: a record the decoder cannot read.
    on_handler_error: fail | dead-letter: a record whose handler raises (after retries).
    handler_retries: attempts more for a record whose handler raises (writes undone).
    dead_letter: s3://bucket/prefix or kinesis://stream for records set aside (default:
                the application's bucket, under `<prefix>/dead-letter`).
    """

    app: str
    streams: tuple[str, ...]
    checkpoint: str
    slices: int = DEFAULT_SLICES
    groups: int = 8
    local_dir: str = field(default_factory=default_local_dir)
    bucket: str | None = None
    prefix: str | None = None
    table: str | None = None
    starting_position: str = "TRIM_HORIZON"
    allow_recount: bool = False
    max_records_per_shard: int = 10_000
    max_bytes_per_shard: int = 10 * 1024 * 1024
    idle_poll_ms: int = 1000
    on_trimmed: str = "fail"
    on_corrupt_aggregate: str = "fail"
    kinesis_endpoint: str | None = None
    allowed_lateness_ms: int = 0
    timer_poll_ms: int = 1000
    value_format: str = "msgpack"
    snapshot_every: int = 32
    snapshot_log_mb: int = 64
    keep_snapshots: int = 3
    transfer_process_mb: float = 64.0
    snapshot_uploads: str = "worker"
    group_owner: str = "worker"
    owner_idle_seconds: int = 600
    decoder: str = "raw"
    on_decode_error: str = "fail"
    on_handler_error: str = "fail"
    handler_retries: int = 0
    dead_letter: str | None = None

    def __post_init__(self) -> None:
        try:
            check_app_name(self.app)
        except ConfigurationError as exc:
            raise ConfigError(f"--app: {exc}") from exc
        if not self.streams:
            raise ConfigError("no Kinesis stream given: pass at least one --stream")
        # The user's own default is made here, private; another is checked if it exists
        # (executors make it, and on a cluster it need not exist where the driver runs).
        private_dir(self.local_dir, create=self.local_dir == str(user_cache_dir()))
        try:
            check_slices(self.slices)
        except ValueError as exc:
            raise ConfigError(f"--slices: {exc}") from exc
        self._check_source()
        self.record_policy()  # raises ConfigError on a bad decoder or policy
        if self.dead_letter is not None:
            target(self.dead_letter)
        if self.value_format not in ("msgpack", "json", "raw", "pickle"):
            raise ConfigError(
                f"value_format {self.value_format!r}: use msgpack (default), json, raw or pickle"
            )
        if self.allowed_lateness_ms < 0:
            raise ConfigError(f"allowed_lateness_ms {self.allowed_lateness_ms}: must be >= 0")
        if not 1 <= self.snapshot_every <= 1000:
            raise ConfigError(
                f"--snapshot-every {self.snapshot_every}: must be between 1 and 1000 versions "
                "(the log between snapshots lives in a DynamoDB item of at most 400 KB)"
            )
        if self.snapshot_log_mb < 1:
            raise ConfigError(f"--snapshot-log-mb {self.snapshot_log_mb}: must be >= 1")
        if not 1 <= self.keep_snapshots <= 20:
            raise ConfigError(f"--keep-snapshots {self.keep_snapshots}: must be between 1 and 20")
        if not 0 <= self.transfer_process_mb <= 1_000_000:
            raise ConfigError(
                f"--transfer-process-mb {self.transfer_process_mb}: must be between 0 (every "
                "restore that fetches anything) and 1000000 (in effect never)"
            )
        if self.snapshot_uploads not in ("helper", "worker"):
            raise ConfigError(
                f"--snapshot-uploads {self.snapshot_uploads!r}: use worker (threads of the "
                "process that runs the group upload snapshots, the default) or helper (the "
                "worker's helper process does)"
            )
        if self.group_owner not in ("worker", "process"):
            raise ConfigError(
                f"--group-owner {self.group_owner!r}: use worker (the Python worker Spark hands "
                "the group runs it, the default) or process (one owner process per group and "
                "host)"
            )
        if self.group_owner == "process":
            check_supported()
        if isinstance(self.owner_idle_seconds, bool) or not 1 <= self.owner_idle_seconds <= 86400:
            raise ConfigError(
                f"--owner-idle-seconds {self.owner_idle_seconds!r}: must be between 1 and 86400"
            )
        if not 1 <= self.groups <= self.slices:
            raise ConfigError(
                f"--groups {self.groups}: must be between 1 and slices ({self.slices})"
            )

    def _check_source(self) -> None:
        try:
            check_starting(self.starting_position)
        except ConfigError as exc:
            raise ConfigError(f"--starting-position: {exc}") from exc
        for flag, value in (
            ("--max-records-per-shard", self.max_records_per_shard),
            ("--max-bytes-per-shard", self.max_bytes_per_shard),
            ("--idle-poll-ms", self.idle_poll_ms),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} {value!r}: must be a positive integer")
        if self.on_trimmed not in ON_TRIMMED:
            raise ConfigError(
                f"--on-trimmed {self.on_trimmed!r}: use fail (default: stop with the shard and "
                "position) or oldest (continue from the oldest record still in the shard)"
            )
        if self.on_corrupt_aggregate not in ON_CORRUPT_AGGREGATE:
            raise ConfigError(
                f"--on-corrupt-aggregate {self.on_corrupt_aggregate!r}: use fail (default: "
                "stop with its coordinates) or skip (log and count it, go on)"
            )
        if self.kinesis_endpoint is not None:
            url = urlparse(self.kinesis_endpoint)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ConfigError(
                    f"--kinesis-endpoint {self.kinesis_endpoint!r}: expected an http:// or "
                    "https:// URL such as http://127.0.0.1:4567"
                )

    def record_policy(self) -> RecordPolicy:
        return RecordPolicy(
            self.decoder, self.on_decode_error, self.on_handler_error, self.handler_retries
        )

    @property
    def location(self) -> AppLocation:
        base = AppLocation.default(self.app)
        return AppLocation(
            app=self.app,
            bucket=self.bucket or base.bucket,
            prefix=base.prefix if self.prefix is None else self.prefix,
            table=self.table or base.table,
        )

    def source_options(self) -> dict[str, str]:
        """Options of the `shardless_kinesis` source for this job."""
        options = {
            "streams": ",".join(self.streams),
            "table": self.location.table,
            "slices": str(self.slices),
            "startingPosition": self.starting_position,
            "maxRecordsPerShard": str(self.max_records_per_shard),
            "maxBytesPerShard": str(self.max_bytes_per_shard),
            "idlePollMs": str(self.idle_poll_ms),
            "onTrimmed": self.on_trimmed,
            "onCorruptAggregate": self.on_corrupt_aggregate,
        }
        if self.kinesis_endpoint:
            options["kinesisEndpoint"] = self.kinesis_endpoint
        return options
