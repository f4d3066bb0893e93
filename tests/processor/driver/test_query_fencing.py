"""Queries fenced from an application's state: a query taken over by a COMMITTED start, or
rolled back behind, cannot commit one more batch, however its reads interleave with the
takeover; throttled and retried commit transactions are told apart from lost ones.

GroupRunner.run over real RocksDB and moto over HTTP, against a plain fold of the batches
that were accepted."""

from __future__ import annotations

from collections import Counter

import pytest
from botocore.exceptions import ClientError

from shardless.changelog import aws, fence, rollback
from shardless.changelog.durable import DurableState, SliceCommit, request_token
from shardless.changelog.errors import ThrottledError
from shardless.changelog.fence import QueryFencedError
from shardless.processor.driver import progress, takeover
from shardless.processor.errors import ConfigError, ProcessorError
from tests.processor.driver.test_committed_start import a_record
from tests.processor.runtime.test_runtime import KEYS, durable_counts, frame, outputs, runner

B0, B1, B2 = KEYS[:100], KEYS[100:200], KEYS[200:300]


def fold(*batches: list[str]) -> dict[str, int]:
    return dict(Counter(k for b in batches for k in b))


def test_a_taken_over_query_cannot_commit_on_top_of_the_new_querys_state(location, tmp_path):
    """Query `old` ran batch 0 and recorded it; `new` starts at COMMITTED from there and
    commits its batch 0. `old` still runs: its next batch starts from the heads it knows,
    loses the conditional write, reads the heads again (now `new`'s) and must not commit
    on top of them: its records would count twice."""
    old, new = runner(location, tmp_path / "old"), runner(location, tmp_path / "new")
    takeover.register(location, "old-query", 0, None)
    old.run(0, "old-query", 0, frame(B0))
    progress.record(location, a_record("old-query", 0))
    fenced = takeover.register(location, "new-query", 0, {"query": "old-query", "batch": 0})
    assert fenced == ["old-query"]
    new.run(0, "new-query", 0, frame(B1, 100))
    with pytest.raises(QueryFencedError, match="query old-query is fenced"):
        old.run(0, "old-query", 1, frame(B2, 200))
    assert durable_counts(location) == fold(B0, B1)
    # the new query goes on, exactly once
    new.run(0, "new-query", 1, frame(B2, 200))
    assert durable_counts(location) == fold(B0, B1, B2)


def test_a_fenced_query_fails_even_on_heads_it_never_saw_before(location, tmp_path):
    """The fence is checked in the commit's own transaction, not only against what the
    query read: a slice the old query never touched is refused too."""
    old = runner(location, tmp_path / "old")
    takeover.register(location, "old-query", 0, None)
    old.run(0, "old-query", 0, frame(["user-1"]))
    progress.record(location, a_record("old-query", 0))
    takeover.register(location, "new-query", 0, {"query": "old-query", "batch": 0})
    with pytest.raises(QueryFencedError):
        old.run(0, "old-query", 1, frame(B1, 100))
    assert durable_counts(location) == fold(["user-1"])


def test_a_rollback_without_a_progress_record_fences_the_rolled_back_query(location, tmp_path):
    """Batches 0-2 of `q` committed, only batch 0 has a progress record with positions...
    the roll-back is to batch 1, which has none. Restarted from its checkpoint, `q` must
    not continue at batch 3 on top of the rolled-back heads (batch 2 would vanish)."""
    r = runner(location, tmp_path)
    takeover.register(location, "q-rolled", 0, None)
    r.run(0, "q-rolled", 0, frame(B0))
    progress.record(location, a_record("q-rolled", 0))
    r.run(0, "q-rolled", 1, frame(B1, 100))
    r.run(0, "q-rolled", 2, frame(B2, 200))
    plan = rollback.plan(location, "q-rolled", 1)
    assert plan.moves
    rollback.apply(location, plan)
    assert "q-rolled" in fence.fenced(location)
    with pytest.raises(QueryFencedError):
        r.run(0, "q-rolled", 3, frame(["user-3"], 300))
    with pytest.raises(ProcessorError, match="may no longer work on application"):
        takeover.register(location, "q-rolled", 3, None)
    assert durable_counts(location) == fold(B0, B1)


def test_a_fenced_check_costs_one_item_per_transaction_not_per_slice(location):
    """The fence check rides in each transaction: 99 heads and one check (DynamoDB's limit
    is 100 items); a commit of 150 slices sends two transactions of at most 100 items."""
    client = aws.client("dynamodb", validated=False)
    sizes: list[int] = []

    def hook(params, **_):
        sizes.append(len(params["TransactItems"]))
        assert params["TransactItems"][-1]["ConditionCheck"]["Key"]["sk"] == {"S": "fence"}
        assert len(params["ClientRequestToken"]) <= 36

    event = "provide-client-params.dynamodb.TransactWriteItems"
    client.meta.events.register(event, hook)
    try:
        commits = [SliceCommit(s % 16, 1, None, [(b"k%d" % s, b"v")]) for s in range(16)]
        DurableState(location).commit("q", 0, 0, commits)
    finally:
        client.meta.events.unregister(event, hook)
    assert sizes == [17]


def test_request_tokens_repeat_for_one_send_and_differ_between_attempts():
    assert request_token("uid-0", 0) == request_token("uid-0", 0)
    assert (
        len({request_token("uid-0", 0), request_token("uid-0", 1), request_token("uid-99", 0)}) == 3
    )
    assert all(len(request_token(f"{'f' * 32}-{n}", n)) <= 36 for n in range(300))


def _cancelled(reasons: list[str]) -> ClientError:
    return ClientError(
        {
            "Error": {"Code": "TransactionCanceledException", "Message": "cancelled"},
            "CancellationReasons": [{"Code": r} for r in reasons],
        },
        "TransactWriteItems",
    )


def test_a_transaction_cancelled_by_throttling_is_retried_not_reported_lost(location, monkeypatch):
    durable = DurableState(location)
    client = aws.client("dynamodb", validated=False)
    real = client.transact_write_items
    calls: list[str] = []

    def throttled_twice(**kw):
        calls.append(kw["ClientRequestToken"])
        if len(calls) <= 2:
            raise _cancelled(["ThrottlingError"] + ["None"] * (len(kw["TransactItems"]) - 1))
        return real(**kw)

    monkeypatch.setattr(client, "transact_write_items", throttled_twice)
    durable.commit("q", 0, 0, [SliceCommit(3, 1, None, [(b"a", b"1")])])
    assert len(calls) == 3 and len(set(calls)) == 3
    assert durable.heads([3])[3].version == 1


def test_a_transaction_throttled_past_every_retry_says_throttled(location, monkeypatch):
    from shardless.changelog import durable as durable_module

    monkeypatch.setattr(durable_module, "_THROTTLED_ATTEMPTS", 2)
    client = aws.client("dynamodb", validated=False)

    def always(**kw):
        raise _cancelled(["None", "ThrottlingError"])

    monkeypatch.setattr(client, "transact_write_items", always)
    with pytest.raises(ThrottledError, match="throttled the transaction 2 times"):
        DurableState(location).commit("q", 0, 0, [SliceCommit(3, 1, None, [(b"a", b"1")])])


def test_outputs_of_the_new_query_are_the_folds(location, tmp_path):
    """After the takeover, the new query's outputs continue the counts exactly once."""
    old, new = runner(location, tmp_path / "old"), runner(location, tmp_path / "new")
    takeover.register(location, "old-query", 0, None)
    old.run(0, "old-query", 0, frame(B0))
    progress.record(location, a_record("old-query", 0))
    takeover.register(location, "new-query", 0, {"query": "old-query", "batch": 0})
    with pytest.raises(QueryFencedError):
        old.run(0, "old-query", 1, frame(B1, 100))
    out = outputs(new.run(0, "new-query", 0, frame(B1, 100)))
    expected = fold(B0, B1)
    assert {o["key"]: o["n"] for o in out} == {k: expected[k] for k in set(B1)}


def test_a_new_query_at_its_own_position_on_state_is_refused_unless_recount(location, tmp_path):
    """A new checkpoint at TRIM_HORIZON on an application with state would count the
    stream twice: refused, unless the user says records may count again; then it fences
    the query before it like a COMMITTED start does."""
    r = runner(location, tmp_path)
    takeover.register(location, "first-q", 0, None)
    r.run(0, "first-q", 0, frame(B0))
    progress.record(location, a_record("first-q", 0))
    with pytest.raises(ProcessorError, match="would count twice.*--allow-recount"):
        takeover.register(location, "second-q", 0, None)
    assert takeover.register(location, "second-q", 0, None, recount=True) == ["first-q"]
    with pytest.raises(QueryFencedError):
        r.run(0, "first-q", 1, frame(B1, 100))


def test_a_query_that_began_but_never_completed_a_batch_is_state_too(location, tmp_path):
    """Its commits are state: a new query at its own position is refused; a COMMITTED start
    undoes them, says there is no progress, and then a start at TRIM_HORIZON is allowed."""
    r = runner(location, tmp_path)
    takeover.register(location, "crashed-q", 0, None)
    r.run(0, "crashed-q", 0, frame(B0))  # the driver dies before recording batch 0
    with pytest.raises(ProcessorError, match="would count twice"):
        takeover.register(location, "fresh-q", 0, None)
    with pytest.raises(ConfigError, match="no recorded progress"):
        takeover.committed_start(location)
    assert durable_counts(location) == {}
    assert takeover.register(location, "fresh-q", 0, None) == []
    with pytest.raises(ProcessorError, match="may no longer work"):
        takeover.register(location, "crashed-q", 0, None)


def test_a_rollback_without_positions_withdraws_the_progress_record(location, tmp_path):
    """Rolled back to a batch with no record, the latest record (batch 2's positions) must
    not be continued by a COMMITTED start: the state no longer holds batch 2."""
    r = runner(location, tmp_path)
    takeover.register(location, "q-rolled", 0, None)
    for b, keys in enumerate((B0, B1, B2)):
        r.run(0, "q-rolled", b, frame(keys, 100 * b))
        if b != 1:
            progress.record(location, a_record("q-rolled", b))
    # batch 1 recorded nothing (idle-skipped, or a driver that died after its commit)
    rollback.apply(location, rollback.plan(location, "q-rolled", 1))
    assert takeover.after_rollback(location, "q-rolled", 1) is None
    with pytest.raises(ConfigError, match="progress was withdrawn"):
        takeover.committed_start(location)
    with pytest.raises(ProcessorError, match="would count twice"):
        takeover.register(location, "next-q", 0, None)
    assert takeover.register(location, "next-q", 0, None, recount=True) == ["q-rolled"]
    assert durable_counts(location) == fold(B0, B1)


def test_a_rollback_to_a_recorded_batch_makes_it_the_latest(location, tmp_path):
    r = runner(location, tmp_path)
    takeover.register(location, "q-rolled", 0, None)
    for b, keys in enumerate((B0, B1, B2)):
        r.run(0, "q-rolled", b, frame(keys, 100 * b))
        progress.record(location, a_record("q-rolled", b))
    rollback.apply(location, rollback.plan(location, "q-rolled", 1))
    assert takeover.after_rollback(location, "q-rolled", 1)["batch"] == 1
    found, _ = takeover.committed_start(location)
    assert (found["query"], found["batch"]) == ("q-rolled", 1)
    assert durable_counts(location) == fold(B0, B1)


def test_a_new_query_on_other_streams_only_starts_and_fences_the_one_before(location, tmp_path):
    """State of stream `clicks` (the record's positions); a new query reading `orders` at
    TRIM_HORIZON counts nothing twice: allowed, and it takes the state over."""
    r = runner(location, tmp_path)
    takeover.register(location, "first-q", 0, None)
    r.run(0, "first-q", 0, frame(B0))
    progress.record(location, a_record("first-q", 0))
    with pytest.raises(ProcessorError, match="would count twice"):
        takeover.register(location, "second-q", 0, None, streams=("orders", "clicks"))
    assert takeover.register(location, "second-q", 0, None, streams=("orders",)) == ["first-q"]
    with pytest.raises(QueryFencedError):
        r.run(0, "first-q", 1, frame(B1, 100))


def test_a_committed_start_fences_the_running_query_before_its_first_batch(location, tmp_path):
    """The new job undoes unrecorded commits before Spark starts, and registers only at its
    first batch. The old query, still running, must not land a batch in between: the new
    query would read those records again (state B0 + B1 + B1)."""
    old, new = runner(location, tmp_path / "old"), runner(location, tmp_path / "new")
    takeover.register(location, "old-query", 0, None)
    old.run(0, "old-query", 0, frame(B0))
    progress.record(location, a_record("old-query", 0))
    takeover.committed_start(location)  # the new job's prepare()
    with pytest.raises(QueryFencedError):
        old.run(0, "old-query", 1, frame(B1, 100))
    with pytest.raises(ProcessorError, match="this query was fenced"):
        progress.record(location, a_record("old-query", 1))
    takeover.register(location, "new-query", 0, {"query": "old-query", "batch": 0})
    new.run(0, "new-query", 0, frame(B1, 100))
    assert durable_counts(location) == fold(B0, B1)


def test_a_rollback_cuts_later_queries_commits_on_slices_the_target_query_never_wrote(
    location, tmp_path
):
    """Query one wrote only user-1's slice; query two, continuing it, wrote other slices.
    Rolled back to query one's batch 0, those commits must go too (found by bench.protocol:
    a slice without query one's history stayed where it was)."""
    from shardless.processor.tools.selection import targets

    r1, r2 = runner(location, tmp_path / "one"), runner(location, tmp_path / "two")
    takeover.register(location, "query-one", 0, None)
    r1.run(0, "query-one", 0, frame(["user-1"]))
    progress.record(location, a_record("query-one", 0))
    takeover.register(location, "query-two", 0, {"query": "query-one", "batch": 0})
    r2.run(0, "query-two", 0, frame(B1, 100))
    progress.record(location, a_record("query-two", 0))
    heads = DurableState(location).heads(list(range(16)))
    cut = targets(heads, list(range(16)), batch=0, query="query-one", loc=location)
    assert sum(cut.values()) == 1  # user-1's slice at v1, every other slice at v0
    rollback.apply(location, rollback.plan(location, "query-one", 0))
    assert durable_counts(location) == fold(["user-1"])
