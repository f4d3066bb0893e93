"""A job's configuration, in one typed place, with defaults that work locally.

Each field carries its `shardless run` help (and choices) in its metadata: the command's
flags are made from the fields (`driver.flags`), so a field, its default and its flag
cannot drift apart."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any
from urllib.parse import urlparse

from shardless.changelog import aws
from shardless.changelog.errors import ConfigurationError
from shardless.changelog.layout import AppLocation, check_app_name
from shardless.processor.api.decoders import DECODERS, ON_DECODE_ERROR
from shardless.processor.api.event_time import LATE_POLICIES, EventTimeChoice
from shardless.processor.api.keys import check_path
from shardless.processor.api.policies import ON_HANDLER_ERROR, RecordPolicy
from shardless.processor.errors import ConfigError
from shardless.processor.kinesis.client import SOURCE_ROLE
from shardless.processor.kinesis.positions import check_starting
from shardless.processor.kinesis.reader import CORRUPT_POLICIES as ON_CORRUPT_AGGREGATE
from shardless.processor.kinesis.reader import POLICIES as ON_TRIMMED
from shardless.processor.kinesis.source import CONSUMER_NAME
from shardless.processor.runtime.dead_letter import target
from shardless.processor.runtime.local_dirs import default_local_dir, private_dir, user_cache_dir
from shardless.processor.runtime.owner import check_supported
from shardless.state.slices import DEFAULT_SLICES, check_slices

VALUE_FORMATS = ("msgpack", "json", "raw", "pickle")
SNAPSHOT_UPLOADS = ("worker", "helper")
GROUP_OWNERS = ("auto", "worker", "process")
COMMIT_FORMATS = ("heads", "chains")


def flag(
    default: Any = MISSING,
    *,
    help: str,
    choices: tuple[str, ...] | None = None,
    factory: Any = MISSING,
) -> Any:
    """A JobConfig field with its `shardless run` help (and choices) in its metadata."""
    meta = {"help": help, "choices": choices}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class JobConfig:
    """Everything a shardless job needs besides the handler. Each field's meaning is its
    `help` (`shardless run --help`; `docs/configuration.md` says more)."""

    app: str = flag(help="application name (owns bucket and table)")
    streams: tuple[str, ...] = flag(help="Kinesis stream (repeat)")
    checkpoint: str = flag(
        help="Spark checkpoint directory (default: ~/.local/state/shardless/checkpoints/APP)"
    )
    slices: int = flag(
        DEFAULT_SLICES,
        help="hash slices of the application's state (fixed for the life of its state)",
    )
    groups: int = flag(
        0,
        help=(
            "slice groups, Spark's shuffle partitions, fixed for the life of a checkpoint; 0 "
            "(default): one per task slot of the cluster where Spark's configuration tells, "
            "else 8"
        ),
    )
    local_dir: str = flag(
        factory=default_local_dir,
        help=(
            "where executors keep slice stores (default: $SHARDLESS_LOCAL_DIR, else "
            "~/.cache/shardless)"
        ),
    )
    bucket: str | None = flag(None, help="S3 bucket for the state (default: shardless-APP)")
    prefix: str | None = flag(None, help="key prefix in the bucket (default: APP; '' for none)")
    table: str | None = flag(None, help="DynamoDB table for the state (default: shardless-APP)")
    starting_position: str = flag(
        "TRIM_HORIZON",
        help=(
            "TRIM_HORIZON, LATEST, AT_TIMESTAMP:<epoch or ISO time>, or COMMITTED (a new "
            "checkpoint continues where the application's committed state left off)"
        ),
    )
    allow_recount: bool = flag(
        False,
        help=(
            "let a new checkpoint at its own starting position run on state that already holds "
            "records of its streams (they count again; refused without this)"
        ),
    )
    max_records_per_shard: int = flag(10_000, help="Kinesis records per batch")
    max_bytes_per_shard: int = flag(10 * 1024 * 1024, help="bytes per batch")
    idle_poll_ms: int = flag(1000, help="with no data, how often to look again")
    on_trimmed: str = flag(
        "fail",
        help=(
            "a position older than the stream's retention: stop, or continue from the oldest "
            "record (logged)"
        ),
        choices=ON_TRIMMED,
    )
    on_corrupt_aggregate: str = flag(
        "fail",
        help="a KPL aggregate that does not decode: stop, or skip it (logged, counted)",
        choices=ON_CORRUPT_AGGREGATE,
    )
    kinesis_endpoint: str | None = flag(
        None, help="Kinesis endpoint URL for the source (default: boto3's)"
    )
    consumer_name: str | None = flag(
        None,
        help=(
            "read with enhanced fan-out through the stream consumer of this name (registered "
            "on each stream, or reused); use a trigger of at least 5 seconds. Default: polling "
            "(GetRecords)"
        ),
    )
    source_role_arn: str | None = flag(
        None,
        help=(
            "an IAM role the source assumes to read the streams (another account's); "
            "default: boto3's own credentials"
        ),
    )
    source_role_external_id: str | None = flag(
        None, help="with --source-role-arn: the external id the role's trust policy asks for"
    )
    source_role_session_name: str | None = flag(
        None, help="with --source-role-arn: the role session's name (default: shardless-APP)"
    )
    state_role_arn: str | None = flag(
        None,
        help=(
            "an IAM role the job assumes for the state's S3 bucket and DynamoDB table; "
            "default: boto3's own credentials"
        ),
    )
    state_role_external_id: str | None = flag(
        None, help="with --state-role-arn: the external id the role's trust policy asks for"
    )
    state_role_session_name: str | None = flag(
        None, help="with --state-role-arn: the role session's name (default: shardless-APP)"
    )
    allowed_lateness_ms: int = flag(
        0,
        help=(
            "event time: the watermark trails the latest event time seen (the arrival time, "
            "unless one is named) by this much"
        ),
    )
    event_time_field: str | None = flag(
        None,
        help=(
            "the records' event time is at this JSON field path (such as event.ts): epoch ms or "
            "an ISO 8601 string (default: the app's event_time, else the arrival time)"
        ),
    )
    on_late: str = flag(
        "process",
        help=(
            "with a named event time, a record at or before the watermark: process it as any "
            "other (default), drop it, or set it aside; counted as late_records either way"
        ),
        choices=LATE_POLICIES,
    )
    timer_poll_ms: int = flag(
        0,
        help=(
            "while event timers are pending, call an idle group at most every this many ms "
            "(default 0: in every batch, so they fire in the first whose watermark passes them)"
        ),
    )
    value_format: str = flag("msgpack", help="how state values are stored", choices=VALUE_FORMATS)
    snapshot_every: int = flag(32, help="versions between a slice's snapshots")
    snapshot_log_mb: int = flag(
        64, help="snapshot sooner once a slice's changelog since its last snapshot is this big"
    )
    keep_snapshots: int = flag(3, help="snapshots kept per slice for roll-back")
    transfer_process_mb: float = flag(
        64.0,
        help=(
            "a restore fetching at least this many MB of snapshots runs its S3 transfers in a "
            "helper process, out of the way of the store opens"
        ),
    )
    snapshot_uploads: str = flag(
        "worker",
        help=(
            "who uploads a slice's snapshots: threads of the process that runs the group "
            "(default), or the worker's helper process, where the uploads' Python does not take "
            "the GIL from the handlers (docs/durability.md)"
        ),
        choices=SNAPSHOT_UPLOADS,
    )
    commit_format: str = flag(
        "chains",
        help=(
            "how a batch commits: one item per group and batch in the group's chain (default; "
            "docs/design/group-commits.md), or the head of every slice it changed (heads: the "
            "format before chains, whose DynamoDB cost grows with the slice count)"
        ),
        choices=COMMIT_FORMATS,
    )
    chain_length: int = flag(
        0,
        help=(
            "with chains: the positions after which a group starts a new chain (0: 256, or 4 "
            "per slice of the group when more); a host without memory of a group reads up to "
            "this many links"
        ),
    )
    group_owner: str = flag(
        "auto",
        help=(
            "who runs a group's batches and keeps its stores: one owner process per group and "
            "host (Linux), so that groups stay put when executors run several tasks at once, or "
            "the Python worker Spark hands it; auto (default): process where executors run "
            "several tasks at once on Linux, else worker"
        ),
        choices=GROUP_OWNERS,
    )
    owner_idle_seconds: int = flag(
        600,
        help="with --group-owner process: an owner process exits after this long without a batch",
    )
    decoder: str = flag(
        "raw", help="what event.value holds: the bytes, a str, or decoded JSON", choices=DECODERS
    )
    on_decode_error: str = flag(
        "fail",
        help=(
            "a record the decoder cannot read: fail the batch, set it aside, or pass the bytes "
            "with event.decode_error set"
        ),
        choices=ON_DECODE_ERROR,
    )
    on_handler_error: str = flag(
        "fail",
        help=(
            "a record whose handler raises (after retries): fail the batch or set it aside (its "
            "writes and outputs undone)"
        ),
        choices=ON_HANDLER_ERROR,
    )
    handler_retries: int = flag(
        0, help="run a record whose handler raised again, up to this many times"
    )
    dead_letter: str | None = flag(
        None,
        help=(
            "s3://bucket/prefix or kinesis://stream for records set aside (default: the "
            "application's bucket, <prefix>/dead-letter)"
        ),
    )
    key_field: str | None = flag(
        None,
        help=(
            "bind state to the string at this JSON field path of each record (such as user.id) "
            "instead of its partition key; records are routed by its MD5 (default: the app's "
            "key, else the partition key)"
        ),
    )
    metrics_port: int = flag(
        0,
        help=(
            "serve each batch's figures to Prometheus at http://HOST:PORT/metrics on the "
            "driver (0: off)"
        ),
    )
    metrics_host: str = flag(
        "0.0.0.0", help="with --metrics-port: the address the endpoint listens on"
    )

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
        self._check_roles()
        self.record_policy()  # raises ConfigError on a bad decoder or policy
        if self.dead_letter is not None:
            target(self.dead_letter)
        if self.key_field is not None:
            try:
                check_path(self.key_field)
            except ConfigError as exc:
                raise ConfigError(f"--key-field: {exc}") from exc
        if self.event_time_field is not None:
            try:
                EventTimeChoice(field=self.event_time_field)
            except ConfigError as exc:
                raise ConfigError(f"--event-time-field: {exc}") from exc
        if self.value_format not in VALUE_FORMATS:
            raise ConfigError(
                f"value_format {self.value_format!r}: use msgpack (default), json, raw or pickle"
            )
        if self.allowed_lateness_ms < 0:
            raise ConfigError(f"allowed_lateness_ms {self.allowed_lateness_ms}: must be >= 0")
        if self.timer_poll_ms < 0:
            raise ConfigError(f"--timer-poll-ms {self.timer_poll_ms}: must be >= 0 (0: each batch)")
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
        if self.group_owner not in GROUP_OWNERS:
            raise ConfigError(
                f"--group-owner {self.group_owner!r}: use auto (the default: process where "
                "executors run several tasks at once on Linux, else worker), worker (the Python "
                "worker Spark hands the group runs it) or process (one owner process per group "
                "and host)"
            )
        if self.group_owner == "process":
            check_supported()
        if isinstance(self.owner_idle_seconds, bool) or not 1 <= self.owner_idle_seconds <= 86400:
            raise ConfigError(
                f"--owner-idle-seconds {self.owner_idle_seconds!r}: must be between 1 and 86400"
            )
        if isinstance(self.chain_length, bool) or not (
            self.chain_length == 0 or 2 <= self.chain_length <= 1_000_000
        ):
            raise ConfigError(
                f"--chain-length {self.chain_length!r}: use 0 (the default rule) or between 2 "
                "and 1000000 positions"
            )
        if isinstance(self.metrics_port, bool) or not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"--metrics-port {self.metrics_port!r}: use 0 (off) or a TCP port, 1-65535"
            )
        if isinstance(self.groups, bool) or not 0 <= self.groups <= self.slices:
            raise ConfigError(
                f"--groups {self.groups!r}: use 0 (one per task slot, the default) or between "
                f"1 and slices ({self.slices})"
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
        if self.consumer_name is not None and not CONSUMER_NAME.fullmatch(self.consumer_name):
            raise ConfigError(
                f"--consumer-name {self.consumer_name!r}: a Kinesis consumer name is 1 to 128 "
                "letters, digits, '_', '.' or '-'"
            )
        if self.kinesis_endpoint is not None:
            url = urlparse(self.kinesis_endpoint)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ConfigError(
                    f"--kinesis-endpoint {self.kinesis_endpoint!r}: expected an http:// or "
                    "https:// URL such as http://127.0.0.1:4567"
                )

    def _check_roles(self) -> None:
        for side in ("source", "state"):
            if getattr(self, f"{side}_role_arn") is None:
                for part in ("external_id", "session_name"):
                    if getattr(self, f"{side}_role_{part}") is not None:
                        raise ConfigError(
                            f"--{side}-role-{part.replace('_', '-')} without --{side}-role-arn: "
                            "give the role's ARN too"
                        )
            self._role(side)  # a malformed ARN, id or name raises ConfigError naming the flag

    def _role(self, side: str) -> aws.Role | None:
        arn = getattr(self, f"{side}_role_arn")
        if arn is None:
            return None
        return aws.Role(
            arn,
            getattr(self, f"{side}_role_external_id"),
            getattr(self, f"{side}_role_session_name") or f"shardless-{self.app}"[:64],
            option=f"--{side}-role-arn",
        )

    @property
    def source_role(self) -> aws.Role | None:
        """The role the source assumes to read the streams, None: boto3's credentials."""
        return self._role("source")

    @property
    def state_role(self) -> aws.Role | None:
        """The role assumed for the state's bucket and table, None: boto3's credentials."""
        return self._role("state")

    def share_roles(self, spark: Any = None) -> None:
        """Make the job's roles this process's and its children's: the variables
        `SHARDLESS_SOURCE_ROLE_*` and `SHARDLESS_STATE_ROLE_*` that every shardless process
        reads. `start()` calls it with the running session (in `prepare()`): Spark gives a
        Python function the environment its context had when the function was made, so the
        variables go into that environment and the job's sources are registered again; the
        sources and the slice groups then have them wherever Spark runs them. Called before a
        session starts, every process of it inherits them."""
        env = {
            **aws.share_role(SOURCE_ROLE, self.source_role),
            **aws.share_role(aws.STATE_ROLE, self.state_role),
        }
        if env and spark is not None:
            from shardless.processor.driver.timer_source import TimerDataSource
            from shardless.processor.kinesis.source import KinesisDataSource

            spark.sparkContext.environment.update(env)
            for source in (KinesisDataSource, TimerDataSource):
                spark.dataSource.register(source)

    def record_policy(self) -> RecordPolicy:
        return RecordPolicy(
            self.decoder,
            self.on_decode_error,
            self.on_handler_error,
            self.handler_retries,
            self.on_late,
        )

    @property
    def location(self) -> AppLocation:
        return AppLocation.of(self.app, self.bucket, self.prefix, self.table)

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
        if self.consumer_name:
            options["consumerName"] = self.consumer_name
        return options
