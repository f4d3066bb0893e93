"""bench.restore's cost counting sees every S3 and DynamoDB call a batch makes, commits
included (they go through a client of their own), and bills them from their real sizes."""

from __future__ import annotations

import pytest

from bench import batch_cost, billing, restore


def test_every_commit_of_a_batch_is_counted_and_billed(aws, tmp_path):  # noqa: ANN001
    requests = billing.Requests()
    try:
        out = batch_cost.batch_cost(
            tmp_path, requests, restore.frame, 256, 8, batches=3, commit_format="heads"
        )
    finally:
        requests.close()
    # 256 slices in 8 groups, every slice changed: each group commits its 32 heads and its
    # fence check in one transaction, and its changes in one segment
    steady = out["steady_batch_requests"]
    assert steady["dynamodb.TransactWriteItems"] == 8 == out["dynamodb_writes_per_batch"]
    assert out["s3_puts_per_batch"] == 8 == steady["s3.PutObject:segment"]
    # a group's due snapshots go out as one pack: at most one snapshot PUT per group
    assert 0 < out["s3_snapshot_puts_per_batch"] <= 8
    assert out["s3_puts_per_batch_with_snapshots"] <= 16
    # each head is a transactional write of at least 2 units; each fence check 2 read units
    assert out["dynamodb_write_units_per_batch"] >= 2 * 256
    assert out["dynamodb_read_units_per_batch"] == 2 * 8
    assert out["idle_batch_requests"] == 0 and out["idle_batch_units"] == 0
    month = out["dollars_per_month"]["trigger_1s"]
    assert month["total"] == month["dynamodb"] + month["s3"] > 0


def test_a_tenth_of_the_slices_costs_a_tenth_of_the_heads(aws, tmp_path):  # noqa: ANN001
    requests = billing.Requests()
    try:
        out = batch_cost.batch_cost(
            tmp_path, requests, restore.frame, 256, 8, 3, touched=0.1, commit_format="heads"
        )
    finally:
        requests.close()
    assert 2 * 26 <= out["dynamodb_write_units_per_batch"] < 2 * 256


def test_a_tenth_of_the_slices_on_chains_costs_one_link_per_group_after_the_first_batch(
    aws, tmp_path
):  # noqa: ANN001
    """The first batch touches every slice, so it takes each over into its group's chain
    (reported apart); after it, a batch touching 10 % of the slices writes one link per
    group that changed something and reads no head."""
    requests = billing.Requests()
    try:
        out = batch_cost.batch_cost(
            tmp_path, requests, restore.frame, 256, 8, 4, touched=0.1, commit_format="chains"
        )
    finally:
        requests.close()
    assert out["dynamodb_write_units_per_batch"] <= 2 * 8
    assert "dynamodb.BatchGetItem" not in out["steady_batch_requests"]
    first = out["first_batch_requests"]
    assert first["dynamodb.TransactWriteItems"] >= 8 and first["s3.PutObject:segment"] == 8


@pytest.mark.slow
def test_a_chain_commit_bills_one_link_per_group_whatever_the_slice_count(aws, tmp_path):  # noqa: ANN001
    """commit_format="chains": each group's batch is one link of under 1 KB (2 write units)
    with its fence check and the check that its chain is alive (2 read units each), at 256
    and at 1,024 slices (128 a group: its first batch takes them over in two transactions),
    every slice changed. `bench.restore` reports 4,096 too; a quarter of the takeover costs
    the suite a quarter of the time."""
    for slices in (256, 1024):
        requests = billing.Requests()
        try:
            out = batch_cost.batch_cost(
                tmp_path / str(slices), requests, restore.frame, slices, 8, 3,
                commit_format="chains",
            )  # fmt: skip
        finally:
            requests.close()
        steady = out["steady_batch_requests"]
        assert steady["dynamodb.TransactWriteItems"] == 8 == out["dynamodb_writes_per_batch"]
        assert out["dynamodb_write_units_per_batch"] == 2 * 8, slices
        assert out["dynamodb_read_units_per_batch"] == 2 * 2 * 8
        assert out["s3_puts_per_batch"] == 8
        assert 0 < out["s3_snapshot_puts_per_batch"] <= 8, slices  # one pack per group
        assert out["idle_batch_requests"] == 0 and out["idle_batch_units"] == 0
        # the first batch took every slice over: one head write each, once
        assert out["first_batch_requests"]["dynamodb.TransactWriteItems"] >= 8


def test_chain_roll_overs_are_counted_and_spread_over_the_chain_length(aws, tmp_path):  # noqa: ANN001
    """A roll-over seals each group's chain, starts a new one and takes every slice over
    again: about a head write (2 units) per slice, which `with_roll_overs` spreads over
    the chain's length. Fails if the takeovers' transactions go uncounted."""
    requests = billing.Requests()
    try:
        steady = batch_cost.batch_cost(tmp_path / "a", requests, restore.frame, 256, 8, 3)
        rolled = batch_cost.batch_cost(
            tmp_path / "b", requests, restore.frame, 256, 8, 5, chain_length=2
        )
    finally:
        requests.close()
    assert steady["dynamodb_write_units_per_batch"] == 2 * 8
    assert rolled["steady_batch_requests"]["dynamodb.PutItem"] >= 8  # seals and new chains
    out = batch_cost.with_roll_overs(steady, rolled, 256)
    assert 2 * 256 <= out["roll_over_write_units"] <= 2 * 256 + 4 * 8
    assert out["dynamodb_write_units_per_batch"] == 2 * 8 + out["roll_over_write_units"] / 256
    assert (
        out["dollars_per_month"]["trigger_1s"]["dynamodb"]
        > (steady["dollars_per_month"]["trigger_1s"]["dynamodb"])
    )


def test_counting_stops_at_close(aws):  # noqa: ANN001
    from shardless.changelog import aws as clients

    requests = billing.Requests()
    requests.close()
    clients.client("dynamodb").list_tables()
    assert requests.take() == ({}, {})


def test_the_group_restore_counts_every_get_of_both_arms(aws, tmp_path):  # noqa: ANN001
    """Both arms restore every slice to its head; the baseline reads each section alone, so
    its GETs are at least the sections applied, and the coalesced arm reads fewer."""
    from bench import restore_group

    out = restore_group.group_restore(
        tmp_path, restore.frame, restore.restore_all, slices=8, batches=6, reps=2
    )
    assert out["group_restore_slices"] == 8
    assert out["group_restore_segments_applied"] >= 8 * 5  # every batch after a snapshot
    one_by_one = out["group_restore_gets_one_by_one"]
    assert one_by_one >= out["group_restore_segments_applied"]
    # one GET per segment (6) and a manifest and file per snapshot, at most
    assert 0 < out["group_restore_gets_coalesced"] <= 6 + 2 * 8 < one_by_one
    assert len(out["group_restore_coalesced_runs_s"]) == 2


@pytest.mark.parametrize("value_bytes", [64, 700_000])  # small files in spans; large alone
def test_the_download_baseline_makes_exactly_the_gets_of_the_restore(
    aws, tmp_path, value_bytes: int
):  # noqa: ANN001
    """`fetch_list` is the baseline's list of GETs: as many as the restore it is compared
    with makes, counted, whether the snapshots' SST files are read in spans or alone."""
    from shardless.changelog.durable import DurableState

    loc = batch_cost.new_app("baseline", restore.SLICES)
    durable = DurableState(loc, transfer_process_bytes=None)
    slices = range(8)
    restore.build_slices(loc, durable, 0, slices, tmp_path / "build", 2, value_bytes, 7)
    heads = durable.heads(list(slices))
    listed = restore.fetch_list(loc, heads)
    requests = billing.Requests()
    try:
        seconds, _, stats, _ = restore.restore_all(
            loc, restore.SLICES, tmp_path / "r", transfer_process_bytes=None
        )
    finally:
        requests.close()
    assert len(stats) == 8 and seconds > 0
    assert requests.calls[("s3", "GetObject")] == len(listed)
    assert len(listed) == (3 if value_bytes == 64 else 2 + 8)
