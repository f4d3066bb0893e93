"""Reusable parts of the fault-injection harness (`python -m bench.faults`).

`procs`: the Spark process tree of a job (driver, executor JVMs, Python workers) and
kill -9 by pid. `schedule`: seeded fault schedules. `partial_put`: a fault proxy that fails
single entries of Kinesis PutRecords calls. `events`: the harness's stream (produce,
reshard). `check`: the job's final state and outputs against a plain-Python fold.
`job`: one `shardless run` driver as a subprocess, with its batch reports.
"""
