"""`bench.protocol`: a seeded slice of the model-based protocol test, and proof that its
oracle fails when the runtime is broken on purpose.

PROTOCOL_RUNS, PROTOCOL_SEED, PROTOCOL_KINDS (comma-separated step kinds, see
`bench.protocol.KINDS`) and PROTOCOL_TIMERS (1: a handler that sets timers) change the
slice."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from bench import protocol
from bench.protocol import Settings, run_once
from bench.protocol_app import Spec
from shardless.processor.runtime import attempt


def settings(max_steps: int = 20) -> Settings:
    kinds = os.environ.get("PROTOCOL_KINDS")
    timers = os.environ.get("PROTOCOL_TIMERS", "1" if protocol.CI_TIMERS else "0") == "1"
    return Settings(
        spec=Spec(timers=timers),
        max_steps=max_steps,
        kinds=tuple(kinds.split(",")) if kinds else protocol.CI_KINDS,
    )


def failures(seed: int, runs: int, s: Settings) -> list[str]:
    found = []
    for run in range(runs):
        r = run_once(seed, run, s)
        if r.violation is not None:
            found.append(f"run {run}: {r.violation} after steps {r.steps}")
    return found


def test_a_seeded_slice_has_no_violations(aws):
    runs = int(os.environ.get("PROTOCOL_RUNS", "5"))
    seed = int(os.environ.get("PROTOCOL_SEED", "7"))
    assert failures(seed, runs, settings()) == []


@pytest.mark.slow
def test_a_longer_slice_has_no_violations(aws):
    # about 20 s; bench.protocol's campaigns run thousands (docs/benchmarks.md)
    assert failures(11, 3, settings(30)) == []


def test_the_oracle_catches_a_batch_applied_twice(aws, monkeypatch):
    """A runtime that does not recognise a re-run of its own batch counts it again."""
    real = attempt._plan

    def no_rerun(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        s, base, rerun = real(*args, **kw)
        return (s, base + 1, False) if rerun else (s, base, rerun)

    steps = [["start", 2], ["run", 0, 0, 0], ["run", 0, 0, 1]]
    assert run_once(1, 0, settings(), steps).violation is None
    monkeypatch.setattr(attempt, "_plan", no_rerun)
    found = run_once(1, 0, settings(), steps).violation
    assert found is not None and found.invariant in ("attempts_disagree", "counted_twice"), found


def test_the_oracle_catches_an_unconditional_commit(aws, monkeypatch):
    """A commit that does not check the head it started from lets a zombie overwrite
    accepted batches."""
    from shardless.changelog import durable

    steps = [
        ["start", 2],
        ["zombie", 0, 0, 1],
        *[["run", 0, g, 0] for g in (0, 1)],
        ["record", 0],
        *[["run", 0, g, 0] for g in (0, 1)],
        ["record", 0],
        ["resume"],
    ]
    heads = settings()
    heads = Settings(replace(heads.spec, commit_format="heads"), heads.max_steps, heads.kinds)
    assert run_once(1, 0, heads, steps).violation is None
    monkeypatch.setattr(durable, "head_condition", lambda head: {})
    found = run_once(1, 0, heads, steps).violation
    assert found is not None, "the zombie's stale commit went unnoticed"


def test_the_oracle_catches_heads_trusted_across_a_gap_unchecked(aws, monkeypatch):
    """A worker that trusts what it knew after an older batch without asking DynamoDB
    (another worker ran the group in the batch between) emits a read batch's counts from
    stale state: the batch commits nothing, so no conditional write stops it. No timers
    and long chains: a due timer's write or a roll-over would read the heads again."""
    s = Settings(spec=Spec(timers=False, chain_length=50), max_steps=30, kinds=protocol.KINDS)
    steps = [["start", 2], ["run", 0, 0, 0], ["run", 0, 1, 0], ["record", 0],
             ["run", 0, 0, 1], ["run", 0, 1, 1], ["record", 0],
             ["run", 0, 0, 0], ["run", 0, 1, 0], ["record", 0]]  # fmt: skip
    assert run_once(1, 8, s, steps).violation is None  # input 2 is a read batch
    monkeypatch.setattr(attempt, "unchanged_since", lambda *args, **kw: True)
    found = run_once(1, 8, s, steps).violation
    assert found is not None and found.invariant == "outputs", found


@pytest.mark.parametrize(
    "seed, run, steps",
    [
        # a roll-back kept a later query's commits on slices its target never wrote
        (28, 4, [["start", 2], ["run", 0, 0, 1], ["run", 0, 1, 1], ["record", 0],
                 ["start", 4], ["run", 1, 2, 0], ["restore", 0, 4]]),
        # reslice carried a batch that never recorded its progress into the new generation
        (5, 6, [["start", 3], ["run", 0, 2, 1], ["reslice", 4]]),
        # after a roll-back withdrew the progress, a query that began and never recorded
        # kept its commits: the next start read those records again
        (5, 9, [["start", 3], ["run", 0, 2, 1], ["run", 0, 1, 0], ["run", 0, 0, 1],
                ["record", 0], ["rollback_unrecorded", 0], ["start", 4], ["run", 1, 1, 1]]),
        # a taken-over query re-ran a group that had nothing to commit (no transaction, so
        # no fence check) on the new query's heads, and released other outputs
        (11, 508, [["start", 3], ["run", 0, 0, 1], ["run", 0, 1, 1], ["run", 0, 2, 1],
                   ["record", 0], ["start", 4], ["run", 1, 1, 2], ["start", 3],
                   ["run", 2, 0, 1], ["move", 1, 2], ["run", 1, 1, 2]]),
        # a zombie stalled between its segment PUT and its commit while gc, two hours
        # apart, deleted the unreferenced segment; resumed, it committed a reference to it
        (12, 1638, [["start", 4], ["run", 0, 2, 1], ["run", 0, 1, 1], ["run", 0, 0, 1],
                    ["run", 0, 3, 1], ["record", 0], ["zombie", 0, 0, 1], ["gc", True],
                    ["gc", True], ["resume"]]),
    ],
)  # fmt: skip
@pytest.mark.parametrize("commit_format", ["heads", "chains"])
def test_the_violations_bench_protocol_found_replay_clean(aws, seed, run, steps, commit_format):
    """Found with heads (then the default); replayed with both formats, on the input they
    were found on (before records could peek)."""
    spec = Spec(timers=True, commit_format=commit_format, peeks=0.0)
    s = Settings(spec=spec, max_steps=30, kinds=protocol.KINDS)
    assert run_once(seed, run, s, steps).violation is None


def test_a_seeded_slice_of_head_commits_has_no_violations(aws):
    """The same slice with commit_format="heads", the format before chains."""
    s = settings()
    s = Settings(replace(s.spec, commit_format="heads"), s.max_steps, s.kinds)
    assert failures(int(os.environ.get("PROTOCOL_SEED", "7")), 5, s) == []


@pytest.mark.parametrize(
    "seed, run, steps",
    [
        # the timer source read heads with a table-only location: a chain needs the bucket
        (1, 0, [["start", 3], ["run", 0, 2, 1]]),
        # rollback conditioned on the stored version of heads read through a chain
        (1, 3, [["start", 4], ["run", 0, 1, 2], ["twin", 0, 3, 2, 1], ["run", 0, 2, 2],
                ["run", 0, 0, 2], ["record", 0], ["run", 0, 0, 0]]),
        # a fenced query's takeover sealed the live chain; the live group's re-run of a
        # committed batch on another worker appended a second link for the same versions
        (1, 10, [["start", 2], ["start", 2], ["start", 2], ["start", 4], ["run", 3, 0, 0],
                 ["run", 1, 0, 1, "s3"], ["run", 3, 0, 2]]),
        # gc deleted the segments of links a slice's snapshots had trimmed; reading the
        # head fetched their indexes anyway
        (2, 52, [["start", 2], ["run", 0, 0, 2], ["run", 0, 1, 2], ["record", 0],
                 ["run", 0, 1, 1], ["run", 0, 0, 2], ["record", 0], ["run", 0, 1, 1],
                 ["run", 0, 0, 2], ["record", 0], ["run", 0, 1, 2], ["gc", True],
                 ["gc", True]]),
        # a re-run of a batch another worker had committed trusted this worker's memory
        # of a slice that commit had changed; it remembered the stale version, and its
        # twin of the next batch, changing nothing, released outputs computed on it
        (23, 444, [["start", 3], ["run", 0, 2, 2], ["run", 0, 0, 2], ["run", 0, 1, 1],
                   ["record", 0], ["run", 0, 1, 1], ["run", 0, 2, 1], ["run", 0, 0, 0],
                   ["run", 0, 0, 2], ["record", 0], ["twin", 0, 0, 2, 0]]),
        # gc sealed and then deleted a chain no head named, seal included; a worker that
        # remembered its tip (its directory moved) took slices over into it, since the
        # position after that tip was free again (gc now marks the genesis dead first)
        (23, 607, [["start", 3], ["run", 0, 2, 0], ["run", 0, 1, 2], ["gc", True],
                   ["run", 0, 0, 2], ["move", 0, 1], ["gc", True], ["record", 0],
                   ["gc", True], ["run", 0, 2, 1]]),
        (23, 713, [["start", 4], ["start", 2], ["run", 1, 1, 1], ["run", 1, 0, 2],
                   ["gc", True], ["gc", True], ["record", 1], ["gc", True],
                   ["run", 1, 0, 2]]),
        # a twin's takeover sealed the chain its remembered head named, read the head again
        # and took it from the chain another worker had moved it to, unsealed; that worker
        # appended the slice's next version there, where no head will read it
        (23, 700, [["start", 2], ["run", 0, 1, 2], ["run", 0, 0, 1], ["record", 0],
                   ["run", 0, 0, 2], ["run", 0, 1, 1], ["record", 0], ["run", 0, 1, 2],
                   ["run", 0, 0, 1], ["run", 0, 1, 1], ["record", 0], ["run", 0, 0, 1],
                   ["twin", 0, 1, 2, 1], ["record", 0]]),
        # a zombie's retry on fresh heads lost its chain position to the batch's other
        # attempt: the runner let its internal StaleHeads out instead of the conflict
        (23, 320, [["start", 2], ["run", 0, 0, 1], ["run", 0, 1, 0], ["record", 0],
                   ["run", 0, 0, 2], ["run", 0, 1, 1], ["run", 0, 0, 1], ["record", 0],
                   ["zombie", 0, 0, 2], ["run", 0, 0, 1]]),
    ],
)  # fmt: skip
def test_the_violations_found_on_the_chain_path_replay_clean(aws, seed, run, steps):
    """On the input they were found on (before records could peek)."""
    s = Settings(spec=Spec(timers=True, commit_format="chains", peeks=0.0), max_steps=30,
                 kinds=protocol.KINDS)  # fmt: skip
    assert run_once(seed, run, s, steps).violation is None


@pytest.mark.slow
def test_parallel_campaigns_cover_the_same_runs_as_one(capsys):
    """`--jobs 2` stripes runs over two campaigns (each with its own moto server); the
    merged report counts the same runs, steps and refusals as one campaign over them."""
    args = ["--seed", "3", "--runs", "3", "--max-steps", "5", "--json"]
    reports = []
    for jobs in ("1", "2"):
        assert protocol.main([*args, "--jobs", jobs]) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    one, two = reports
    assert two["jobs"] == 2 and two["runs"] == one["runs"] == 3
    assert (two["steps"], two["refused"]) == (one["steps"], one["refused"])
