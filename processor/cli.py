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
from shardless.processor.driver.flags import add_job_flags
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
    from shardless.processor.driver.flags import job_config
    from shardless.processor.driver.job import console_sink, parquet_sink, start
    from shardless.processor.driver.spark import session

    handler = load_handler(args.app_file)
    cfg = job_config(args, checkpoint=args.checkpoint or default_checkpoint(args.app))
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
    add_job_flags(run)
    run.add_argument("--output", help="write outputs as Parquet here (default: console)")
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
