"""What a group runner needs to know besides its handler: where the application's state
lives, how to snapshot, which owner runs the batch, and the record policy. Built by the
driver from `JobConfig` and pickled to the executors with the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardless.changelog.layout import AppLocation
from shardless.changelog.transfer_process import TRANSFER_PROCESS_BYTES
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.runtime.owner import OWNER_IDLE_SECONDS
from shardless.state import encoding

Pending = dict[int, tuple[int | None, int | None]]  # slice -> (next processing, next event)


@dataclass(frozen=True)
class RuntimeConfig:
    location: AppLocation
    slices: int
    local_dir: str
    snapshot_every: int = 32
    snapshot_log_bytes: int = 64 * 1024 * 1024
    keep_snapshots: int = 3
    transfer_process_bytes: int | None = TRANSFER_PROCESS_BYTES
    # "worker": snapshots upload on threads of the process that runs the group; "helper": in
    # the worker's helper process (`shardless.changelog.transfer_process`)
    snapshot_uploads: str = "worker"
    value_format: int = encoding.MSGPACK
    allow_pickle: bool = False
    # while event timers are pending, call an idle group at most every this many ms; 0:
    # in every batch, so they fire in the first batch whose watermark passes them
    timer_poll_ms: int = 0
    # the decoder and what to do with records that cannot be decoded or processed
    policy: RecordPolicy = field(default_factory=RecordPolicy)
    # where records set aside go (`shardless.processor.runtime.dead_letter.target`); None: the
    # application's bucket under `<prefix>/dead-letter`
    dead_letter: str | None = None
    # "worker": the Python worker Spark hands the group runs it with its own stores;
    # "process": the group's owner process on this host does (`shardless.processor.runtime.owner`)
    group_owner: str = "worker"
    owner_idle_seconds: int = OWNER_IDLE_SECONDS
    # the shuffle partitions the job laid its group keys out for: a group then refuses
    # slices outside its range (None: no check, for callers without Spark)
    partitions: int | None = None
    # "chains": one link per group and batch (docs/design/group-commits.md); "heads": a
    # batch writes the head of every slice it changed
    commit_format: str = "chains"
    # with "chains": the positions after which a group starts a new chain, taking its slices
    # over into it as they change (None: `group_chain.chain_limit`'s rule)
    chain_length: int | None = None

    def dead_letter_target(self) -> str:
        return self.dead_letter or f"s3://{self.location.bucket}/{self.location.prefix}/dead-letter"
