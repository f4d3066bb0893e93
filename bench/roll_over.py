"""A group's roll-over batch, when its chain of commits reaches its length and it starts a
new one: `python -m bench.roll_over --json`.

One group of 128 slices (one of a default job's two groups on 2 task slots) is driven
through `GroupRunner.run` on moto server, every slice changed in every batch, for one
chain's length of batches plus the roll-over batch (`chain_length`, 512 by default: what
`chain_limit` gives a 128-slice group). The roll-over batch seals the old chain and takes
every slice over into a new one. Two arms, alternated rep by rep, each on a new app:

- `settled` (the default since 2026-11-27): the seal landed right after the tip the group
  committed last, so the heads it knows are final and are written as they are;
- `reread` (before): every head read again through the sealed chain (`sealed_again`),
  all of its links and the segment indexes its heads' logs need.

Figures: the `chain` phase of the roll-over batch (the group's own timing), against the
median of the batches before it; the slices read again through chains in that batch (a
count of `DurableState.heads` calls' slices, which a run refuses unless it is 128 for
`reread` and 0 for `settled`), and its DynamoDB Query calls and S3 GETs
(`bench.billing.Requests`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import harness
from bench.batch_cost import counter, keys_by_slice, new_app
from bench.billing import Requests
from bench.restore import frame
from shardless.changelog.chain_reads import all_chains
from shardless.changelog.durable import DurableState
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime import attempt
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig

ARMS = ("settled", "reread")
QUERY = "bench-roll-over"
NOW_MS = 1_700_000_000_000


@contextmanager
def arm(name: str) -> Iterator[list[int]]:
    """Run the roll-over as `name` does; yields the count of slices read through chains by
    `DurableState.heads` while it is on."""
    read: list[int] = [0]
    heads, roll_over = DurableState.heads, attempt.roll_over

    def counted(self: DurableState, slices: list[int]) -> Any:
        read[0] += len(slices)
        return heads(self, slices)

    def unsettled(*args: Any) -> Any:  # the roll-over as it was: no head taken as final
        tip, _ = roll_over(*args)
        return tip, frozenset()

    DurableState.heads = counted  # type: ignore[method-assign]
    if name == "reread":
        attempt.roll_over = unsettled  # type: ignore[assignment]
    try:
        yield read
    finally:
        DurableState.heads = heads  # type: ignore[method-assign]
        attempt.roll_over = roll_over  # type: ignore[assignment]


def one_rep(name: str, root: Path, slices: int, length: int, per: int) -> dict[str, Any]:
    """`length` batches, then the roll-over batch, on a new app: its figures."""
    loc = new_app(f"roll-{name}", slices)
    cfg = RuntimeConfig(loc, slices, str(root), chain_length=length)
    runner = GroupRunner(HandlerFactory(counter), cfg)
    by_slice = keys_by_slice(slices, 40, "user-")
    pending: dict = {}
    seq, steady = 0, []
    with arm(name) as read:
        for b in range(length + 1):
            rows = [(ks[(b * per + j) % len(ks)], s) for s, ks in enumerate(by_slice)
                    for j in range(per)]  # fmt: skip
            if b == length:
                read[0] = 0
                requests = Requests()
            try:
                out, pending = runner.run(0, QUERY, b, frame(rows, seq), pending, NOW_MS + b)
            finally:
                if b == length:
                    requests.close()
            seq += len(rows)
            metrics = json.loads(out[out.kind == "metrics"].value.iloc[0])
            if b < length:
                steady.append(metrics["timings"].get("chain", 0.0))
    return {
        "chain_s": metrics["timings"].get("chain", 0.0),
        "seconds": metrics["seconds"],
        "steady_chain_s": statistics.median(steady[1:]),  # the first batch makes the chain
        "heads_reread": read[0],
        "queries": requests.calls[("dynamodb", "Query")],
        "gets": requests.calls[("s3", "GetObject")],
        "chains": len(all_chains(loc)),
    }


def check(name: str, rep: dict[str, Any], slices: int) -> None:
    """Refuse a rep that did not take its arm's path, or did not roll over."""
    want = slices if name == "reread" else 0
    if rep["heads_reread"] != want:
        raise RuntimeError(
            f"arm {name}: {rep['heads_reread']} heads read again in the roll-over batch, "
            f"not {want}: the arm did not take its path"
        )
    if rep["chains"] != 2:
        raise RuntimeError(f"arm {name}: {rep['chains']} chains after the run, not 2")


def measure(
    tmp: Path, slices: int = 128, length: int = 512, per: int = 10, reps: int = 2
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    for r in range(reps):
        for name in ARMS if r % 2 == 0 else ARMS[::-1]:
            rep = one_rep(name, tmp / f"{name}-{r}", slices, length, per)
            check(name, rep, slices)
            runs[name].append(rep)
    out: dict[str, Any] = {}
    for name in ARMS:
        for key in ("chain_s", "seconds", "steady_chain_s", "queries", "gets"):
            out[f"{name}_{key}"] = round(statistics.median(x[key] for x in runs[name]), 4)
        out[f"{name}_heads_reread"] = runs[name][0]["heads_reread"]
    out["chain_s_settled_over_reread"] = round(out["settled_chain_s"] / out["reread_chain_s"], 4)
    out["runs"] = runs
    out["config"] = {"slices": slices, "chain_length": length, "records_per_slice": per,
                     "reps": reps}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a chain of 64, one rep each")
    parser.add_argument("--chain-length", type=int, help="positions before the roll-over")
    parser.add_argument("--reps", type=int, help="reps of each arm (default 2)")
    args = parser.parse_args(argv)
    length = args.chain_length or (64 if args.quick else 512)
    reps = args.reps or (1 if args.quick else 2)
    harness.quiet()
    with harness.emulated_aws("shardless-bench-roll-over-") as (tmp, _):
        out = measure(tmp, length=length, reps=reps)
    harness.print_result(out, args.json)


if __name__ == "__main__":
    main()
