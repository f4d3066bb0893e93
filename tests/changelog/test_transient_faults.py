"""S3 and DynamoDB failing the way AWS fails, through a fault-injecting proxy in front of
moto server: transient 5xx and throttling are retried and change nothing; a persistent
failure fails the batch with nothing half-committed; a commit applied but reported as
failed is recognised when the batch runs again."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from botocore.retries.standard import ExponentialBackoff

from shardless.changelog import durable as durable_module
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import CommitConflictError
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.rules import Rule
from tests.processor.runtime.test_runtime import (
    KEYS,
    SLICES,
    durable_counts,
    frame,
    outputs,
    runner,
)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry decisions are under test, not botocore's sleeps."""
    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.0)


@pytest.fixture
def proxy(aws, monkeypatch: pytest.MonkeyPatch):
    with FaultProxy(aws.s3_endpoint, seed=11) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", p.url)
        monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", p.url)
        yield p


def batches(r, n: int) -> list[dict]:
    seen = []
    for b in range(n):
        seen += outputs(r.run(0, "q", b, frame(KEYS[b * 100 : (b + 1) * 100], b * 100)))
    return seen


def test_transient_errors_are_retried_and_change_nothing(location, tmp_path, proxy):
    for service, op, status, error in [
        ("s3", "PutObject", 503, "SlowDown"),
        ("s3", "GetObject", 500, "InternalError"),
        ("dynamodb", "TransactWriteItems", 400, "ProvisionedThroughputExceededException"),
        ("dynamodb", "BatchGetItem", 500, "InternalServerError"),
        ("dynamodb", "TransactWriteItems", 400, "ThrottlingException"),
    ]:
        proxy.add(Rule(service, op, status=status, error=error, probability=0.3))
    r = runner(location, tmp_path, snapshot_every=2)
    seen = batches(r, 4)
    assert sum(proxy.injected().values()) >= 3  # the faults did happen
    assert durable_counts(location) == Counter(KEYS)
    per_key: dict[str, list[int]] = {}
    for o in seen:
        per_key.setdefault(o["key"], []).append(o["n"])
    assert all(ns == list(range(1, len(ns) + 1)) for ns in per_key.values())


def test_heads_a_throttled_table_leaves_unprocessed_are_read_again_and_change_nothing(
    location, tmp_path, proxy, monkeypatch
):
    """A host that knows no heads reads them (its first batch, and a second host taking the
    group over); DynamoDB answers part of each read. The keys left out are asked for again,
    and every record counts once, as a fold of the input says."""
    monkeypatch.setattr(durable_module, "_unprocessed_pause_s", lambda attempt: 0.0)
    proxy.add(Rule("dynamodb", "BatchGetItem", unprocessed=5, times=4))
    first = batches(runner(location, tmp_path / "a"), 2)
    second = outputs(runner(location, tmp_path / "b").run(0, "q", 2, frame(KEYS[200:300], 200)))
    assert proxy.injected() == {("dynamodb", "BatchGetItem"): 4}
    assert durable_counts(location) == Counter(KEYS[:300])
    per_key: dict[str, list[int]] = {}
    for o in first + second:
        per_key.setdefault(o["key"], []).append(o["n"])
    assert all(ns == list(range(1, len(ns) + 1)) for ns in per_key.values())


def test_a_persistent_failure_fails_the_batch_with_nothing_committed(location, tmp_path, proxy):
    r = runner(location, tmp_path)
    batches(r, 1)
    before = DurableState(location).heads(list(range(SLICES)))
    proxy.add(Rule("dynamodb", "TransactWriteItems", status=500, error="InternalServerError"))
    with pytest.raises(Exception, match="InternalServerError"):
        r.run(0, "q", 1, frame(KEYS[100:200], 100))
    after = DurableState(location).heads(list(range(SLICES)))
    assert {s: h.version for s, h in after.items()} == {s: h.version for s, h in before.items()}
    proxy.clear()
    # the batch runs again once the service is back: its input counts once
    r.run(0, "q", 1, frame(KEYS[100:200], 100))
    assert durable_counts(location) == Counter(KEYS[:200])


def test_a_commit_applied_but_reported_failed_is_recognised_on_rerun(location, tmp_path, proxy):
    """DynamoDB applied the transaction, the client saw a 500 and retried; the retry's
    condition fails against the head it just wrote. The batch fails without touching the
    local stores; Spark runs it again, which finds its own commit and re-commits in place."""
    r = runner(location, tmp_path)
    batches(r, 1)
    proxy.add(Rule("dynamodb", "TransactWriteItems", status=500, after=True, times=1))
    try:
        first = outputs(r.run(0, "q", 1, frame(KEYS[100:200], 100)))
    except CommitConflictError:
        first = None  # moto ignores ClientRequestToken, so the retry's condition fails
    assert proxy.injected()[("dynamodb", "TransactWriteItems")] == 1
    rerun = outputs(r.run(0, "q", 1, frame(KEYS[100:200], 100)))
    assert first is None or first == rerun
    assert durable_counts(location) == Counter(KEYS[:200])
    assert (
        outputs(r.run(0, "q", 2, frame(["user-3"], 300)))[0]["n"]
        == Counter(KEYS[:200])["user-3"] + 1
    )


WIDE_KEYS = [f"user-{i % 3000}" for i in range(6000)]


def wide_group(location, tmp_path: Path, commit_format: str):  # noqa: ANN001, ANN201
    """One group of 256 slices, its application, and `batch(b)` running input batch `b`
    (3,000 records over 3,000 keys) through it, returning the outputs."""
    from shardless.changelog import resources
    from shardless.changelog.layout import AppLocation
    from shardless.processor.api.handlers import HandlerFactory
    from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig
    from shardless.processor.runtime.routing import route
    from tests.processor.runtime.test_runtime import count_handler

    loc = AppLocation.default(f"{location.app}-{commit_format}")
    resources.ensure(loc, 256)
    cfg = RuntimeConfig(loc, 256, str(tmp_path), commit_format=commit_format)
    group = GroupRunner(HandlerFactory(count_handler), cfg)

    def batch(b: int) -> list[dict]:
        pdf = frame(WIDE_KEYS[b * 3000 : (b + 1) * 3000], b * 3000)
        pdf["slice"] = [route(k, None, 256) for k in pdf.partition_key]
        out, _ = group.run(0, "q", b, pdf, {}, 1_000)
        return outputs(out)

    first = min(route(k, None, 256) for k in WIDE_KEYS)  # in the first of three transactions
    return loc, batch, first


def test_a_wide_group_whose_first_transaction_fails_counts_each_record_once(
    location, tmp_path, proxy
):
    """A group of 256 slices commits in three transactions, sent together (heads). The
    first one fails for good while the other two land; the batch fails, and when it runs
    again the slices that landed find their own commit and re-commit in place: every
    record counts once, against a plain fold of the input."""
    from shardless.changelog.layout import slice_pk

    loc, batch, first = wide_group(location, tmp_path, "heads")
    batch(0)
    rule = Rule("dynamodb", "TransactWriteItems", key_contains=f'"{slice_pk(first)}"', status=500)
    proxy.add(rule)
    with pytest.raises(Exception, match="InternalServerError") as failed:
        batch(1)
    assert "2 of its 3 transactions landed" in str(failed.value.__notes__)
    heads = DurableState(loc).heads(list(range(256)))
    assert sorted({h.version for h in heads.values()}) == [1, 2]  # some landed, some did not
    assert heads[first].version == 1
    proxy.clear()
    rerun = batch(1)
    assert {o["key"]: o["n"] for o in rerun} == {k: 2 for k in WIDE_KEYS[3000:]}
    found = DurableState(loc).heads(list(range(256)))
    assert all(h.version == 2 and h.batch == 1 for h in found.values())
    assert durable_counts(loc, 256) == Counter(WIDE_KEYS)


def test_a_wide_takeover_whose_first_transaction_fails_counts_each_record_once(
    location, tmp_path, proxy
):
    """With chains, a group's first batch takes its 256 slices over in three transactions.
    The first fails for good while the other two land: nothing is committed, and when the
    batch runs again it takes the rest over and commits once: every record counts once."""
    from shardless.changelog.layout import slice_pk

    loc, batch, first = wide_group(location, tmp_path, "chains")
    rule = Rule("dynamodb", "TransactWriteItems", key_contains=f'"{slice_pk(first)}"', status=500)
    proxy.add(rule)
    with pytest.raises(Exception, match="InternalServerError"):
        batch(0)
    heads = DurableState(loc).heads(list(range(256)))
    assert heads and first not in heads  # some slices were taken over, not the first's
    assert not any(h.committed for h in heads.values())
    proxy.clear()
    batch(0)
    assert {o["key"]: o["n"] for o in batch(1)} == {k: 2 for k in WIDE_KEYS[3000:]}
    found = DurableState(loc).heads(list(range(256)))
    assert all(h.version == 2 and h.batch == 1 for h in found.values())
    assert durable_counts(loc, 256) == Counter(WIDE_KEYS)
