"""How long a query takes to start and drain a small stream, by default and with either of
the two things that make it faster turned off: `python -m bench.query_start --json`.

Each run is a new driver process with a new `local[2]` session made by shardless's own
`session()`, on the project's emulators. It runs `--queries` queries one after another,
each a new application over a new stream of `--records` records (2 shards, one batch),
`--available-now`, with the default configuration otherwise. Every query start makes
Spark start the processes that plan its two Python data sources (the Kinesis source and
the timer source) and run them as streaming sources, and each new application's first
batch starts its groups' owner processes. Three arms take turns run by run:

- `default`: the context starts its Python processes through
  `installed_pyspark.launcher`, which takes PySpark's shipped zips off their path, and
  each owner is a fork of the executor's zygote, which has the owner's imports done;
- `direct`: the launcher turned off (as before it existed): those processes compile
  PySpark from Spark's zip. Task workers come from shardless's daemon in every arm;
- `spawn`: `SHARDLESS_OWNER_ZYGOTE=0` (as before the zygote): each owner is a new
  interpreter that does its own imports.

A run is refused if its context did not take its arm's interpreter, if its owners were
not forks of a zygote (or, under `spawn`, were), or if its queries did not deliver every
record. Figures, per arm: the median over the runs of a query's seconds from `start()`
until it ended (its one batch delivered), the first query of each run apart (it also warms
the session up); and the ratios of the later queries' medians, `default` over each other
arm, from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from shardless.processor.runtime.owner import ZYGOTE_ENV

ARMS = ("default", "direct", "spawn")

SHARDS = 2

_RUN = """\
import json, random, sys, time, uuid
from pathlib import Path
if {arm!r} == "direct":
    from shardless.processor.runtime import installed_pyspark
    installed_pyspark.launcher = lambda python=None: None
from shardless.processor.api.app import load_handler
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.job import parquet_sink, start
from shardless.processor.driver.spark import session
from shardless.processor.kinesis.client import kinesis_client
from shardless.processor.local.faults import events

work = Path({work!r})
kinesis = kinesis_client()
streams = []
for i in range({queries}):
    name = f"qs-{{uuid.uuid4().hex[:10]}}"
    events.create_stream(kinesis, name, {shards})
    events.wait_active(kinesis, name)
    events.produce(kinesis, name, 0, {records}, 40, random.Random(i))
    streams.append(name)
spark = session("local[2]", groups=2, ui=False)
handler = load_handler(Path({app!r}))
queries = []
for i, stream in enumerate(streams):
    cfg = JobConfig(app=f"qs-{{uuid.uuid4().hex[:10]}}", streams=(stream,),
                    checkpoint=str(work / f"checkpoint-{{i}}"), local_dir=str(work / "stores"),
                    groups=2, max_records_per_shard={per_shard})
    reports = []
    began = time.perf_counter()
    query = start(spark, handler, cfg, sink=parquet_sink(str(work / f"out-{{i}}")),
                  on_report=reports.append, available_now=True)
    query.awaitTermination()
    queries.append({{"seconds": time.perf_counter() - began, "batches": len(reports),
                    "records": sum(r.records for r in reports)}})
python_exec = spark.sparkContext.pythonExec
owners = sorted({{p for r in reports for p in r.group_pids.values()}})  # the last query's
parents = []
for pid in owners:
    ppid = [ln.split()[1] for ln in open(f"/proc/{{pid}}/status") if ln.startswith("PPid:")][0]
    parents.append(open(f"/proc/{{ppid}}/cmdline").read().replace("\\0", " "))
spark.stop()
print("RESULT " + json.dumps({{"python_exec": python_exec, "python": sys.executable,
                              "queries": queries, "owner_parents": parents}}))
"""


def run_once(arm: str, work: Path, queries: int, records: int) -> dict[str, Any]:
    """One new driver process of `arm`: each query's seconds. Refuses a run whose context
    did not take its arm's interpreter, or whose queries did not deliver every record."""
    from shardless.processor.local.faults.driver import REPO

    folder = Path(tempfile.mkdtemp(prefix=f"{arm}-", dir=work))
    script = _RUN.format(
        arm=arm, work=str(folder), queries=queries, shards=SHARDS, records=records,
        per_shard=records, app=str(REPO / "examples" / "user_activity.py"),
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.pop(ZYGOTE_ENV, None)
    if arm == "spawn":
        env[ZYGOTE_ENV] = "0"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900
    )
    found = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        raise RuntimeError(f"the {arm} run failed:\n{done.stderr[-3000:]}")
    result = json.loads(found[0])
    check(arm, result, queries, records)
    return result


def check(arm: str, result: dict[str, Any], queries: int, records: int) -> None:
    """The context took its arm's interpreter (the launcher, or the driver's own Python),
    the owners were forks of a zygote or not as the arm has them, and every query delivered
    every record."""
    launched = result["python_exec"] != result["python"]
    if launched != (arm != "direct"):
        raise RuntimeError(f"the {arm} run's context ran Python as {result['python_exec']}")
    parents = result["owner_parents"]
    forked = [" zygote " in p for p in parents]
    if not parents or any(f != (arm != "spawn") for f in forked):
        raise RuntimeError(f"the {arm} run's owners were started by {parents}")
    got = [q["records"] for q in result["queries"]]
    if got != [records] * queries:
        raise RuntimeError(f"the {arm} run's queries delivered {got} records, not {records} each")


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm, medians of the first queries' and the later queries' figures; the later
    queries' ratios, `default` over each other arm, and the seconds it saves."""
    arms: dict[str, dict[str, Any]] = {}
    for arm, rs in runs.items():
        first = [r["queries"][0] for r in rs]
        later = [q for r in rs for q in r["queries"][1:]]
        arms[arm] = {
            "runs": len(rs),
            "first_query_s": _median([q["seconds"] for q in first]),
            "query_s": _median([q["seconds"] for q in later]) if later else None,
            "batches": _median([q["batches"] for r in rs for q in r["queries"]]),
        }
    out: dict[str, Any] = {"arms": arms}
    on = arms["default"]["query_s"]
    for other in (a for a in arms if a != "default"):
        off = arms[other]["query_s"]
        out[f"query_default_over_{other}"] = round(on / off, 3) if on and off else None
        out[f"query_saved_s_against_{other}"] = round(off - on, 3) if on and off else None
    out["runs"] = runs
    return out


def measure(reps: int, queries: int, records: int) -> dict[str, Any]:
    from shardless.processor.local import emulators as local_aws

    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="bench-query-start-") as tmp:
        aws = local_aws.start("kinesalite", log_dir=Path(tmp) / "local-aws")
        try:
            with aws.env_applied():
                for i in range(reps):
                    for arm in ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]:
                        runs[arm].append(run_once(arm, Path(tmp), queries, records))
        finally:
            aws.stop()
    out = summarize(runs)
    out.update(queries_per_run=queries, records_per_query=records, master="local[2]")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the JSON summary only")
    p.add_argument("--reps", type=int, default=3, help="runs of each arm, alternated")
    p.add_argument("--queries", type=int, default=4, help="queries per run")
    p.add_argument("--records", type=int, default=800, help="records per query's stream")
    args = p.parse_args(argv)
    out = measure(args.reps, args.queries, args.records)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for arm, f in out["arms"].items():
            print(
                f"{arm:9s} first query {f['first_query_s']:6.2f} s  later queries "
                f"{f['query_s']:5.2f} s"
            )
        for other in ARMS[1:]:
            print(f"later queries, default / {other}: {out[f'query_default_over_{other}']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
