"""The `shardless` command line.

shardless local up [--kinesis kinesalite|kinesis-local]   # prints `export ...` lines
shardless local down
shardless run app.py --app NAME --stream NAME [options]
shardless demo
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

from shardless.changelog.errors import ChangelogError
from shardless.processor.errors import ProcessorError
from shardless.processor.local import emulators as local_aws
from shardless.processor.tools import state_cli

STATE_FILE = Path(".shardless/local.json")


def _local_up(args: argparse.Namespace) -> int:
    state = Path(args.state_file)
    if state.exists():
        print(
            f"{state} exists: emulators may be running; run 'shardless local down' first",
            file=sys.stderr,
        )
        return 1
    aws = local_aws.start(args.kinesis, log_dir=state.parent / "logs")
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(aws.to_json())
    for name, value in aws.env().items():
        print(f"export {name}={value}")
    print(
        f"# started {aws.kinesis_flavour} and moto server; stop with `shardless local down`",
        file=sys.stderr,
    )
    return 0


def _local_down(args: argparse.Namespace) -> int:
    state = Path(args.state_file)
    if not state.exists():
        print(f"no {state}: nothing started by `shardless local up` here", file=sys.stderr)
        return 0
    local_aws.LocalAws.from_json(state.read_text()).stop()
    state.unlink()
    return 0


def default_checkpoint(app: str) -> str:
    """`<user state dir>/checkpoints/<app>`, under a private (0o700) `checkpoints` made
    now: `$XDG_STATE_HOME/shardless` or `~/.local/state/shardless`. (`app` is checked by
    `JobConfig` before anything is made under it.)"""
    from shardless.processor.runtime.local_dirs import private_dir, user_state_dir

    return str(private_dir(user_state_dir() / "checkpoints") / app)


def _run(args: argparse.Namespace) -> int:
    from shardless.processor.api.app import load_handler
    from shardless.processor.driver.config import JobConfig
    from shardless.processor.driver.job import console_sink, parquet_sink, start
    from shardless.processor.driver.spark import session

    handler = load_handler(args.app_file)
    cfg = JobConfig(
        app=args.app,
        streams=tuple(args.stream),
        checkpoint=args.checkpoint or default_checkpoint(args.app),
        slices=args.slices,
        groups=args.groups,
        starting_position=args.starting_position,
        allow_recount=args.allow_recount,
        max_records_per_shard=args.max_records_per_shard,
        max_bytes_per_shard=args.max_bytes_per_shard,
        idle_poll_ms=args.idle_poll_ms,
        on_trimmed=args.on_trimmed,
        on_corrupt_aggregate=args.on_corrupt_aggregate,
        kinesis_endpoint=args.kinesis_endpoint,
        allowed_lateness_ms=args.allowed_lateness_ms,
        value_format=args.value_format,
        snapshot_every=args.snapshot_every,
        snapshot_log_mb=args.snapshot_log_mb,
        keep_snapshots=args.keep_snapshots,
        transfer_process_mb=args.transfer_process_mb,
        snapshot_uploads=args.snapshot_uploads,
        group_owner=args.group_owner,
        owner_idle_seconds=args.owner_idle_seconds,
        decoder=args.decoder,
        on_decode_error=args.on_decode_error,
        on_handler_error=args.on_handler_error,
        handler_retries=args.handler_retries,
        dead_letter=args.dead_letter,
        **({"local_dir": args.local_dir} if args.local_dir else {}),
    )
    spark = session(args.master, groups=cfg.groups, app_name=f"shardless-{cfg.app}")
    sink = parquet_sink(args.output) if args.output else console_sink
    query = start(
        spark,
        handler,
        cfg,
        sink=sink,
        available_now=args.available_now,
        processing_time=args.trigger,
    )
    try:
        query.awaitTermination()
    except Exception as exc:
        # Spark wraps a failed batch in pages of JVM trace; the cause is one of our lines.
        cause = our_error(str(exc))
        if cause is not None:
            raise ProcessorError(cause) from exc
        raise
    return 0


_OUR_ERROR = re.compile(r"^\s*shardless\.[\w.]+\.\w*(?:Error|Exception): (.+)$")


def our_error(text: str) -> str | None:
    """The message of the last shardless exception in a Spark failure's text (the Python
    traceback's final line names the cause), or None."""
    found = [m.group(1) for line in text.splitlines() if (m := _OUR_ERROR.match(line))]
    return found[-1] if found else None


def _produce(args: argparse.Namespace) -> int:
    from shardless.changelog import aws
    from shardless.processor.local.producer import ensure_stream, produce

    kinesis = aws.client("kinesis")
    ensure_stream(kinesis, args.stream, args.shards)
    seconds = produce(kinesis, args.stream, args.events, args.users, args.zipf, args.seed)
    print(f"put {args.events} events for {args.users} users into {args.stream} in {seconds:.1f}s")
    return 0


def _demo(_: argparse.Namespace) -> int:
    from shardless.processor.local import demo

    return demo.main()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardless", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    local = sub.add_parser("local", help="local AWS emulators on 127.0.0.1")
    local_sub = local.add_subparsers(dest="action", required=True)
    up = local_sub.add_parser("up", help="start moto server and a Kinesis emulator")
    up.add_argument("--kinesis", choices=local_aws.KINESIS_FLAVOURS, default="kinesalite")
    up.add_argument("--state-file", default=str(STATE_FILE))
    up.set_defaults(func=_local_up)
    down = local_sub.add_parser("down", help="stop what `local up` started")
    down.add_argument("--state-file", default=str(STATE_FILE))
    down.set_defaults(func=_local_down)

    run = sub.add_parser("run", help="run an app file's process(event, ctx) over Kinesis")
    run.add_argument("app_file")
    run.add_argument("--app", required=True, help="application name (owns bucket and table)")
    run.add_argument("--stream", action="append", required=True, help="Kinesis stream (repeat)")
    run.add_argument("--slices", type=int, default=256)
    run.add_argument("--groups", type=int, default=8, help="Spark shuffle partitions")
    run.add_argument(
        "--checkpoint",
        help="Spark checkpoint directory (default: ~/.local/state/shardless/checkpoints/APP)",
    )
    run.add_argument(
        "--local-dir",
        help="where executors keep slice stores (default: $SHARDLESS_LOCAL_DIR, else "
        "~/.cache/shardless)",
    )
    run.add_argument("--output", help="write outputs as Parquet here (default: console)")
    run.add_argument(
        "--starting-position",
        default="TRIM_HORIZON",
        help="TRIM_HORIZON, LATEST, AT_TIMESTAMP:<epoch or ISO time>, or COMMITTED (a new "
        "checkpoint continues where the application's committed state left off)",
    )
    run.add_argument(
        "--allow-recount",
        action="store_true",
        help="let a new checkpoint at its own starting position run on state that already "
        "holds records of its streams (they count again; refused without this)",
    )
    run.add_argument(
        "--max-records-per-shard", type=int, default=10_000, help="Kinesis records per batch"
    )
    run.add_argument(
        "--max-bytes-per-shard", type=int, default=10 * 1024 * 1024, help="bytes per batch"
    )
    run.add_argument(
        "--idle-poll-ms", type=int, default=1000, help="with no data, how often to look again"
    )
    run.add_argument(
        "--on-trimmed",
        choices=("fail", "oldest"),
        default="fail",
        help="a position older than the stream's retention: stop, or continue from the "
        "oldest record (logged)",
    )
    run.add_argument(
        "--on-corrupt-aggregate",
        choices=("fail", "skip"),
        default="fail",
        help="a KPL aggregate that does not decode: stop, or skip it (logged, counted)",
    )
    run.add_argument(
        "--kinesis-endpoint", help="Kinesis endpoint URL for the source (default: boto3's)"
    )
    run.add_argument(
        "--allowed-lateness-ms",
        type=int,
        default=0,
        help="event time: the watermark trails the latest arrival by this much",
    )
    run.add_argument(
        "--value-format",
        choices=("msgpack", "json", "raw", "pickle"),
        default="msgpack",
        help="how state values are stored",
    )
    run.add_argument(
        "--snapshot-every", type=int, default=32, help="versions between a slice's snapshots"
    )
    run.add_argument(
        "--transfer-process-mb",
        type=float,
        default=64.0,
        help="a restore fetching at least this many MB of snapshots runs its S3 transfers in "
        "a helper process, out of the way of the store opens",
    )
    run.add_argument(
        "--snapshot-uploads",
        choices=("worker", "helper"),
        default="worker",
        help="who uploads a slice's snapshots: threads of the process that runs the group "
        "(default), or the worker's helper process, where the uploads' Python does not take "
        "the GIL from the handlers (docs/durability.md)",
    )
    run.add_argument(
        "--group-owner",
        choices=("worker", "process"),
        default="worker",
        help="who runs a group's batches and keeps its stores: the Python worker Spark hands "
        "it (default), or one owner process per group and host (Linux), so that groups stay "
        "put when executors have several cores",
    )
    run.add_argument(
        "--owner-idle-seconds",
        type=int,
        default=600,
        help="with --group-owner process: an owner process exits after this long without a batch",
    )
    run.add_argument(
        "--snapshot-log-mb",
        type=int,
        default=64,
        help="snapshot sooner once a slice's changelog since its last snapshot is this big",
    )
    run.add_argument(
        "--keep-snapshots", type=int, default=3, help="snapshots kept per slice for roll-back"
    )
    run.add_argument(
        "--decoder",
        choices=("raw", "utf8", "json"),
        default="raw",
        help="what event.value holds: the bytes, a str, or decoded JSON",
    )
    run.add_argument(
        "--on-decode-error",
        choices=("fail", "dead-letter", "raw"),
        default="fail",
        help="a record the decoder cannot read: fail the batch, set it aside, or pass the "
        "bytes with event.decode_error set",
    )
    run.add_argument(
        "--on-handler-error",
        choices=("fail", "dead-letter"),
        default="fail",
        help="a record whose handler raises (after retries): fail the batch or set it aside "
        "(its writes and outputs undone)",
    )
    run.add_argument(
        "--handler-retries",
        type=int,
        default=0,
        help="run a record whose handler raised again, up to this many times",
    )
    run.add_argument(
        "--dead-letter",
        help="s3://bucket/prefix or kinesis://stream for records set aside (default: the "
        "application's bucket, <prefix>/dead-letter)",
    )
    run.add_argument(
        "--master",
        help="Spark master (default: spark-submit's --master when launched by spark-submit, "
        "else local[2])",
    )
    when = run.add_mutually_exclusive_group()
    when.add_argument("--available-now", action="store_true", help="process what is there, stop")
    when.add_argument("--trigger", help="processing-time trigger, e.g. '5 seconds'")
    run.set_defaults(func=_run)

    produce = sub.add_parser("produce", help="put sample per-user events into a stream")
    produce.add_argument("--stream", required=True)
    produce.add_argument("--shards", type=int, default=4, help="if the stream must be created")
    produce.add_argument("--events", type=int, default=100_000)
    produce.add_argument("--users", type=int, default=5_000)
    produce.add_argument("--zipf", type=float, default=1.1, help="skew of user ids")
    produce.add_argument("--seed", type=int, default=7)
    produce.set_defaults(func=_produce)

    demo = sub.add_parser("demo", help="the end-to-end demo on local emulators")
    demo.set_defaults(func=_demo)
    state_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("py4j", "botocore", "urllib3", "boto3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ProcessorError, ChangelogError, local_aws.LocalAwsError) as exc:
        print(f"shardless: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
