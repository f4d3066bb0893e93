"""Reusable parts of the fault-injection harness (`python -m bench.faults`).

- `procs`: the Spark process tree of a job (driver, executor JVMs, Python workers), kill -9.
- `schedule`: seeded fault schedules.
- `fault_proxy`: the fault proxy (its HTTP side in `forwarding`, rules in `rules`, AWS error
  answers in `aws_answers`, partial PutRecords failures in `partial_failures`).
- `events`: the harness's stream (produce, reshard).
- `driver`: one `shardless run` driver as a subprocess, with its batch reports.
- `runner`: one schedule run against the job (its pieces in `outcome`, `job`, `inject`,
  `operator_actions`); `check`: the job's final state and outputs against a plain-Python
  fold.
"""
