"""A new executor's first Python tasks, with PySpark imported from its installed package or
from Spark's zip of it: `python -m bench.cold_start --json`.

Each run is a new driver process with a new `local-cluster[2,1,1024]` (two new executor
JVMs, no Python worker yet: what a replacement executor or a restarted job starts from),
made by shardless's own `session()`. It runs one job whose two tasks, one per executor,
each start a Python worker and import what a slice group's task imports when Spark hands
it the group's function (`shardless.processor.runtime.group_runner`), then the same job
again, on the now warm workers. Two arms alternate run by run:

- `installed`: the default (`spark.python.daemon.module` set to shardless's daemon, which
  takes Spark's shipped zips off the workers' path: `installed_pyspark`);
- `zip`: the deployment sets PySpark's own daemon (`spark-defaults.conf`), as before.

Each task reports where it imported PySpark from, and a run whose workers did not take
their arm's path is refused. Figures: per arm, the median of the first job's seconds, of
the second's, and of their difference (what the cold start costs); the ratio of the
differences, `installed` over `zip`, in the same run; and where the first job's time went
(`parts`), from the wall-clock times the tasks take and their processes' start times.
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

ARMS = ("installed", "zip")
MASTER = "local-cluster[2,1,1024]"

_RUN = """\
import json, os, sys, time
started = time.perf_counter()
from shardless.processor.driver.spark import session
spark = session({master!r}, groups=2, ui=False)
ready = time.perf_counter()
import pandas as pd


def probe(pdf):
    called = time.time()
    import pyspark
    import shardless.processor.runtime.group_runner  # noqa: F401 - a group task's imports
    imported = time.time()
    boot = time.time() - float(open("/proc/uptime").read().split()[0])
    tick = os.sysconf("SC_CLK_TCK")

    def began(pid):  # the process's start, wall clock (its /proc start time, in ticks)
        fields = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()
        return boot + int(fields[19]) / tick

    return pd.DataFrame({{"part": [int(pdf.part.iloc[0])], "pid": [os.getpid()],
                         "pyspark": [pyspark.__file__], "daemon_at": [began(os.getppid())],
                         "worker_at": [began(os.getpid())], "called_at": [called],
                         "imported_at": [imported]}})


df = spark.range(0, 2, 1, 2).selectExpr("id as part")
schema = ("part long, pid long, pyspark string, daemon_at double, worker_at double, "
          "called_at double, imported_at double")
jobs = []
for _ in range(2):
    t, wall = time.perf_counter(), time.time()
    rows = df.groupBy("part").applyInPandas(probe, schema).collect()
    jobs.append((time.perf_counter() - t, wall, time.time(), [r.asDict() for r in rows]))
conf = spark.sparkContext.getConf().get("spark.python.daemon.module", "pyspark.daemon")
spark.stop()
print("RESULT " + json.dumps({{"session_s": ready - started, "daemon": conf,
                              "jobs": [{{"seconds": s, "submitted": w, "ended": e, "rows": r}}
                                       for s, w, e, r in jobs]}}))
"""

PARTS = ("to_daemon_s", "daemon_to_worker_s", "worker_to_call_s", "imports_s", "back_s")


def parts(job: dict[str, Any]) -> dict[str, float]:
    """Where a first job's time went, per task (medians over the executors): from its
    submission until the executor started the Python daemon (the JVM's part), until the
    daemon forked the worker, until the worker called the function, the function's
    imports, and from there until the job ended."""
    rows = job["rows"]

    def median(f: Any) -> float:
        return round(statistics.median(f(r) for r in rows), 3)

    return dict(
        zip(
            PARTS,
            (
                median(lambda r: r["daemon_at"] - job["submitted"]),
                median(lambda r: r["worker_at"] - r["daemon_at"]),
                median(lambda r: r["called_at"] - r["worker_at"]),
                median(lambda r: r["imported_at"] - r["called_at"]),
                median(lambda r: job["ended"] - r["imported_at"]),
            ),
            strict=True,
        )
    )


def run_once(arm: str, work: Path) -> dict[str, Any]:
    """One new driver process of `arm`; its two jobs' seconds and where its tasks found
    PySpark. Refuses a run whose workers took the other arm's path."""
    conf = work / f"conf-{arm}"
    conf.mkdir(parents=True, exist_ok=True)
    defaults = "spark.python.daemon.module pyspark.daemon\n" if arm == "zip" else ""
    (conf / "spark-defaults.conf").write_text(defaults)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(SPARK_CONF_DIR=str(conf), SPARK_LOCAL_IP="127.0.0.1")
    done = subprocess.run(
        [sys.executable, "-c", _RUN.format(master=MASTER)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    found = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        raise RuntimeError(f"the {arm} run failed:\n{done.stderr[-3000:]}")
    result = json.loads(found[0])
    check(arm, result)
    first, second = (j["seconds"] for j in result["jobs"])
    return {
        "first_s": first,
        "second_s": second,
        "cold_s": first - second,
        "session_s": result["session_s"],
        "workers": len({r["pid"] for j in result["jobs"] for r in j["rows"]}),
        "first_job": parts(result["jobs"][0]),
    }


def check(arm: str, result: dict[str, Any]) -> None:
    """Each task of the run imported PySpark where its arm says, and both executors ran one."""
    rows = [r for j in result["jobs"] for r in j["rows"]]
    zipped = [".zip" + os.sep in r["pyspark"] for r in rows]
    want_zip = arm == "zip"
    if len(rows) != 4 or any(z != want_zip for z in zipped):
        raise RuntimeError(
            f"the {arm} run's tasks imported PySpark from "
            f"{sorted({r['pyspark'] for r in rows})} (daemon {result['daemon']})"
        )


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    arms = {
        arm: {
            key: round(statistics.median(r[key] for r in rs), 3)
            for key in ("first_s", "second_s", "cold_s", "session_s")
        }
        | {
            "first_job": {
                k: round(statistics.median(r["first_job"][k] for r in rs), 3) for k in PARTS
            }
        }
        | {"runs": len(rs)}
        for arm, rs in runs.items()
    }
    cold = arms["zip"]["cold_s"]
    return {
        "master": MASTER,
        "arms": arms,
        "cold_installed_over_zip": round(arms["installed"]["cold_s"] / cold, 3) if cold else None,
        "first_job_saved_s": round(arms["zip"]["first_s"] - arms["installed"]["first_s"], 3),
        "runs": runs,
    }


def measure(reps: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        for i in range(reps):
            for arm in ARMS if i % 2 == 0 else reversed(ARMS):
                runs[arm].append(run_once(arm, Path(tmp)))
    return summarize(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the JSON summary only")
    p.add_argument("--reps", type=int, default=5, help="runs of each arm, alternated")
    args = p.parse_args(argv)
    out = measure(args.reps)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for arm, f in out["arms"].items():
            print(
                f"{arm:10s} first job {f['first_s']:6.2f} s  second {f['second_s']:5.2f} s"
                f"  cold start {f['cold_s']:5.2f} s  session {f['session_s']:5.2f} s"
            )
        print(f"cold start, installed / zip: {out['cold_installed_over_zip']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
