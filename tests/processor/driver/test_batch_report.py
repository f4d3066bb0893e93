"""`BatchReport`: one batch's figures from its groups' metrics rows, and the log line that
says where the slowest group's time went."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from shardless.processor.driver.job import SLOWEST_PHASES, BatchReport, longest_phases


def row(group: int, seconds: float, timings: dict[str, float], records: int = 10) -> str:
    return json.dumps(
        {
            "group": group,
            "records": records,
            "outputs": records,
            "committed_slices": 4,
            "segment_bytes": 100,
            "seconds": seconds,
            "timers_fired": 0,
            "restores": [],
            "pid": 100 + group,
            "timings": timings,
        }
    )


FAST = {"process": 0.1, "commit_s3": 0.05, "heads": 0.01, "local_commit": 0.02}
STALLED = {"process": 0.09, "commit_s3": 1.95, "local_commit": 0.03, "heads": 0.002}


def test_a_slow_batch_names_its_slowest_groups_longest_phases() -> None:
    """A batch held up by one group's S3 commit says so in its log line, whichever order the
    groups' rows come in."""
    for rows in ([row(0, 0.2, FAST), row(1, 2.1, STALLED)],
                 [row(1, 2.1, STALLED), row(0, 0.2, FAST)]):  # fmt: skip
        report = BatchReport.of(7, rows)
        assert report.group_seconds_max == 2.1
        assert list(report.slowest_phases.items()) == [
            ("commit_s3", 1.95), ("process", 0.09), ("local_commit", 0.03)
        ]  # fmt: skip
        assert report.records == 20 and report.group_pids == {0: 100, 1: 101}
        line = json.loads(json.dumps(report.summary()))
        assert line["slowest_phases"] == {"commit_s3": 1.95, "process": 0.09, "local_commit": 0.03}


def test_a_row_without_timings_leaves_the_phases_empty() -> None:
    report = BatchReport.of(0, [row(0, 0.3, {})])
    assert report.slowest_phases == {} and report.group_seconds_max == 0.3
    assert BatchReport.of(1, []).slowest_phases == {}


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.floats(0, 100), max_size=12))
def test_longest_phases_are_the_longest_longest_first(timings: dict[str, float]) -> None:
    got = longest_phases(timings)
    assert len(got) == min(SLOWEST_PHASES, len(timings))
    assert set(got) <= set(timings)
    values = list(got.values())
    assert values == sorted(values, reverse=True)
    left_out = [v for k, v in timings.items() if k not in got]
    assert all(round(v, 3) <= min(values) for v in left_out)  # nothing longer left out
