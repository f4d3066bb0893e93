"""bench.idle_group counts what each arm's batch asks of S3 and DynamoDB, and each arm takes
the path it is named for (the bench itself refuses a batch that did not)."""

from __future__ import annotations

from bench import idle_group


def test_each_arm_is_counted_on_its_own_path(aws):  # noqa: ANN001
    out = idle_group.measure(slices=8, history=6, idle=2, reps=2, per=2)
    arms = out["arms"]
    # the batch's own commit: one transaction
    assert arms["steady"]["dynamodb_requests"] == 1 and arms["steady"]["s3_gets"] == 0
    # the check: a Query of the chain's tip and a BatchGetItem of the heads, then the commit
    assert arms["vouched"]["dynamodb_requests"] == 3 and arms["vouched"]["s3_gets"] == 0
    assert arms["vouched"]["heads_read"] == 0
    # read again through the chain: the heads twice, the chain, a segment index per link
    afresh = arms["read_afresh"]
    assert afresh["heads_read"] == 2 * 8 and afresh["s3_gets"] >= 6
    assert afresh["dynamodb_requests"] > arms["vouched"]["dynamodb_requests"]
    assert len(arms["steady"]["seconds_each"]) == 2
