"""Reusable parts of the fault-injection harness (`python -m bench.faults`).

`procs`: the Spark process tree of a job (driver, executor JVMs, Python workers) and
kill -9 by pid. `schedule`: seeded fault schedules. `proxy`: the fault proxy with per-rule
counts and partial PutRecords failures. `events`: the harness's stream (produce, reshard).
`driver`: one `shardless run` driver as a subprocess, with its batch reports. `runner`:
one schedule run against the job and judged. `check`: the job's final state and outputs
against a plain-Python fold.
"""
