"""bench.head_items: both layouts it compares really write (and fence) what they claim, and
its report holds every variant with ratios to the per-slice layout."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable


def test_the_block_layout_writes_each_slices_head_and_refuses_a_stale_token(
    in_process_moto: Callable[[str], list[str]],
) -> None:
    printed = in_process_moto(
        """
        from bench import head_items as h
        with mock_aws():
            ddb = boto3.client("dynamodb")
            h._table(ddb)
            tokens = {}
            h._block_batch(ddb, tokens, 32)
            h._block_batch(ddb, tokens, 32)
            item = ddb.get_item(TableName="t", Key={"pk": {"S": "block#00001"},
                                                    "sk": {"S": "head"}})["Item"]
            heads = sorted(k for k in item if k.startswith("h"))
            assert heads == [f"h{s:05d}" for s in range(32, 64)], heads
            assert item["t00040"]["S"] == tokens[40]
            tokens[40] = "stale"
            try:
                h._block_batch(ddb, tokens, 32)
            except ddb.exceptions.TransactionCanceledException:
                print("refused")
            logs = {}
            h._per_slice_batch(ddb, logs, 1)
            h._per_slice_batch(ddb, logs, 2)
            n = ddb.scan(TableName="t", Select="COUNT")["Count"]
            print(n)
        """
    )
    assert printed == ["refused", str(256 // 32 + 256)]


def test_the_report_has_every_variant_against_the_per_slice_layout() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.head_items", "--rounds", "1", "--batches", "1", "--json"],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    report = json.loads(out.stdout)
    variants = {"per_slice", "per_slice_moto_as_released", "blocks_of_16", "blocks_of_32",
                "blocks_of_64"}  # fmt: skip
    assert set(report["cpu_s_per_batch"]) == variants
    assert all(v > 0 for v in report["cpu_s_per_batch"].values())
    assert set(report["ratio_to_per_slice"]) == variants
    assert all(len(runs) == 1 for runs in report["runs"].values())
