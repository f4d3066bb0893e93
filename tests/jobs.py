"""The job configuration most end-to-end tests run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardless.changelog.layout import AppLocation
from shardless.processor.driver.config import JobConfig

# The variables that carry the source's and the state's roles to every process.
ROLE_VARIABLES = [
    f"SHARDLESS_{side}_ROLE_{part}"
    for side in ("STATE", "SOURCE")
    for part in ("ARN", "EXTERNAL_ID", "SESSION_NAME")
]


def job_config(
    location: AppLocation,
    streams: tuple[str, ...],
    tmp_path: Path,
    checkpoint: str = "checkpoint",
    **fields: Any,
) -> JobConfig:
    """The test's application reading `streams`, 16 slices in 2 groups (one per task slot of
    the suite's local[2], as `--groups 0` would choose), its checkpoint and stores under
    `tmp_path`; `fields` override or add any other setting."""
    defaults: dict[str, Any] = {
        "app": location.app,
        "streams": streams,
        "checkpoint": str(tmp_path / checkpoint),
        "slices": 16,
        "groups": 2,
        "local_dir": str(tmp_path / "stores"),
        # `auto` (the default) runs owner processes under the suite's local[2]: 4 more
        # processes to start per job, about a fifth more time per Spark test. The suite
        # runs the worker path; tests/processor/runtime/test_group_owner.py runs `auto`.
        "group_owner": "worker",
    }
    return JobConfig(**(defaults | fields))


def capture_cli_starts(monkeypatch: Any) -> list[JobConfig]:
    """Make `shardless run` build its JobConfig and stop there: the configs it would have
    started, without Spark."""
    seen: list[JobConfig] = []

    class Query:
        def awaitTermination(self) -> None:  # noqa: N802
            pass

    def fake_start(spark: Any, handler: Any, cfg: JobConfig, **_: object) -> Query:
        seen.append(cfg)
        return Query()

    monkeypatch.setattr("shardless.processor.driver.job.start", fake_start)
    monkeypatch.setattr("shardless.processor.driver.spark.session", lambda *a, **k: None)
    return seen
