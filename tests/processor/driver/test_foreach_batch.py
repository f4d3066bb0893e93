"""A user's foreach_batch function as the sink: each batch's outputs once its state is
committed, at least once, with a batch identity that stays the same when the batch runs
again; deduplicated by that identity, the outputs are the fold (real Spark, emulated AWS,
through `shardless run --foreach-batch MODULE:FUNCTION`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shardless.processor import cli
from shardless.processor.api.app import load_app
from shardless.processor.driver.foreach_batch import BatchIdentity, import_function
from shardless.processor.errors import ConfigError
from tests.processor.driver.test_typed_outputs import emitted, produce, running_fold, write_app

# What `deliver` was called with: (identity, the rows it saw, whether it raised).
CALLS: list[tuple[BatchIdentity, list[dict[str, Any]], bool]] = []


def deliver(df, batch: BatchIdentity) -> None:  # noqa: ANN001
    """Takes the batch's rows; the first call raises after seeing them, as a sink whose
    write failed half way."""
    rows = [r.asDict() for r in df.collect()]
    fail = not CALLS
    CALLS.append((batch, rows, fail))
    if fail:
        raise OSError("the database went away")


@pytest.fixture
def calls() -> Iterator[list[tuple[BatchIdentity, list[dict[str, Any]], bool]]]:
    CALLS.clear()
    yield CALLS
    CALLS.clear()


def run(app, stream: str, app_name: str, tmp_path, *more: str) -> int:  # noqa: ANN001
    return cli.main(
        [
            "run", str(app), "--app", app_name, "--stream", stream, "--slices", "16",
            "--groups", "4", "--available-now", "--max-records-per-shard", "100",
            "--checkpoint", str(tmp_path / "ck"), "--local-dir", str(tmp_path / "st"), *more,
        ]
    )  # fmt: skip


@pytest.mark.slow
def test_a_batch_run_again_reaches_the_function_again_with_the_same_identity(
    spark, kinesis, make_stream, location, tmp_path, capsys, calls
):
    stream = make_stream(2)
    sent = produce(kinesis, stream, 500)
    app = write_app(tmp_path)
    function = f"{__name__}:deliver"

    assert run(app, stream, location.app, tmp_path, "--foreach-batch", function) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    [(first, seen_first, failed)] = calls
    assert failed and first.batch_id == 0
    assert err == (
        f"shardless: foreach_batch {function} failed on batch {first.query_id}/0: OSError: the "
        "database went away; the batch's state is committed: restarting the job runs the "
        "batch again and calls the function again with the same batch identity"
    )

    assert run(app, stream, location.app, tmp_path, "--foreach-batch", function) == 0
    retry, seen_retry, _ = calls[1]
    assert retry == first  # the same query id and batch id on the re-run
    assert sorted(seen_retry, key=str) == sorted(seen_first, key=str)
    identities = [batch for batch, _, _ in calls[1:]]
    assert len(set(identities)) == len(identities) >= 3
    assert {b.query_id for b in identities} == {first.query_id}
    assert [b.batch_id for b in identities] == list(range(len(identities)))

    delivered = {}  # deduplicated by batch identity: the last delivery of each
    for batch, rows, _ in calls:
        assert len({(r["slice"], r["seq"]) for r in rows}) == len(rows)  # once per call
        delivered[batch] = rows
    assert emitted([r for rows in delivered.values() for r in rows]) == running_fold(sent)


def test_the_app_s_foreach_batch_is_the_sink_unless_a_flag_names_another(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(
        "def process(event, ctx):\n    ctx.emit(1)\n\n\ndef foreach_batch(df, batch):\n    pass\n"
    )
    loaded = load_app(app)
    assert loaded.foreach_batch is not None and loaded.foreach_batch.__name__ == "foreach_batch"
    base = ["run", str(app), "--app", "a", "--stream", "s"]
    named = cli._sink(cli.parse_args(base), loaded)
    assert named.__qualname__.startswith("foreach_batch_sink")
    parquet = cli._sink(cli.parse_args([*base, "--output", str(tmp_path / "o")]), loaded)
    assert parquet.__qualname__.startswith("parquet_sink")
    with pytest.raises(SystemExit):
        cli.parse_args([*base, "--output", "o", "--foreach-batch", f"{__name__}:deliver"])


def test_foreach_batch_names_a_function_that_can_be_imported():
    assert import_function(f"{__name__}:deliver") is deliver
    with pytest.raises(ConfigError, match="give MODULE:FUNCTION"):
        import_function("deliver")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_here'"):
        import_function("no_such_module_here:write")
    with pytest.raises(ConfigError, match="has no 'nothing'"):
        import_function(f"{__name__}:nothing")
