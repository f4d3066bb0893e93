"""What users touch: the handler API, routing, the Kinesis source, the job and the CLI.

`processor` builds on `changelog` and `state`.
"""
