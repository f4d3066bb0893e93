"""bench.restore's request counting sees every S3 and DynamoDB call a batch makes, commits
included (they go through a client of their own)."""

from __future__ import annotations

from bench import restore


def test_every_commit_of_a_batch_is_counted(aws, tmp_path):  # noqa: ANN001
    requests = restore.Requests()
    try:
        out = restore.batch_requests(tmp_path, requests, batches=3, per_slice=1)
    finally:
        requests.close()
    # 256 slices in 8 groups, every slice changed: each group commits its 32 heads in one
    # transaction and its changes in one segment
    steady = out["steady_batch_requests"]
    assert steady["dynamodb.TransactWriteItems"] == restore.GROUPS
    assert out["dynamodb_writes_per_batch"] == restore.GROUPS
    assert out["s3_puts_per_batch"] == restore.GROUPS == steady["s3.PutObject:segment"]


def test_counting_stops_at_close(aws):  # noqa: ANN001
    from shardless.changelog import aws as clients

    requests = restore.Requests()
    requests.close()
    clients.client("dynamodb").list_tables()
    assert requests.take() == {}
