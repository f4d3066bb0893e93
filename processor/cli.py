"""The `shardless` command line.

shardless local up [--kinesis kinesalite|kinesis-local]   # prints `export ...` lines
shardless local down
shardless run app.py --app NAME --stream NAME [options]
shardless demo
shardless --version | [--log-level LEVEL] [--log-format text|json] COMMAND ...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from shardless.changelog.errors import ChangelogError
from shardless.processor.driver import settings
from shardless.processor.driver.flags import add_job_flags
from shardless.processor.errors import ConfigError, ProcessorError
from shardless.processor.local import emulators as local_aws
from shardless.processor.tools import state_cli

if TYPE_CHECKING:
    from shardless.processor.api.app import App
    from shardless.processor.driver.job import Sink

STATE_FILE = Path(".shardless/local.json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_NOISY = ("py4j", "botocore", "urllib3", "boto3")
_SETTINGS_HELP = (
    "Every option can also be set by a variable, SHARDLESS_ and its name in capitals "
    "(SHARDLESS_SNAPSHOT_EVERY=16, SHARDLESS_STREAMS=a,b), and in the TOML file of --config "
    'FILE or $SHARDLESS_CONFIG (snapshot_every = 16, streams = ["a", "b"]). The command line '
    "wins over the environment, which wins over the file (docs/configuration.md)."
)


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


def _sink(args: argparse.Namespace, app: App) -> Sink:
    """Where the outputs go: `--foreach-batch`'s function, `--output`'s Parquet, the app's
    `foreach_batch`, else the console."""
    from shardless.processor.driver.foreach_batch import foreach_batch_sink, import_function
    from shardless.processor.driver.job import console_sink, parquet_sink

    if args.foreach_batch:
        function = import_function(args.foreach_batch)
        return foreach_batch_sink(function, name=args.foreach_batch)
    if args.output:
        return parquet_sink(args.output)
    if app.foreach_batch is not None:
        return foreach_batch_sink(app.foreach_batch, name=f"{args.app_file}:foreach_batch")
    return console_sink


def _run(args: argparse.Namespace) -> int:
    from shardless.processor.api.app import load_app
    from shardless.processor.driver import recorder
    from shardless.processor.driver.flags import job_config
    from shardless.processor.driver.job import start
    from shardless.processor.driver.spark import session

    app = load_app(args.app_file)
    try:
        cfg = job_config(args, checkpoint=args.checkpoint or default_checkpoint(args.app))
        sink = _sink(args, app)
    except ConfigError as exc:  # say so when the value it names came from a variable or file
        raise settings.located(exc, getattr(args, "set_by", {})) from exc
    # A checkpoint's own group count wins over --groups; size the session for it.
    groups = cfg.groups or recorder.local_checkpoint_partitions(cfg.checkpoint) or 0
    spark = session(args.master, groups=groups, app_name=f"shardless-{cfg.app}")
    query = start(
        spark,
        app.handlers,
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


def _consumer_deregister(args: argparse.Namespace) -> int:
    from shardless.processor.kinesis.source import deregister_consumers

    found = deregister_consumers(args.stream, args.consumer_name, args.kinesis_endpoint)
    for stream, was in found.items():
        what = "deregistered" if was else "had no consumer named"
        print(f"{stream}: {what} {args.consumer_name}")
    return 0


def _demo(_: argparse.Namespace) -> int:
    from shardless.processor.local import demo

    return demo.main()


def version() -> str:
    """The installed package's version (what `shardless --version` prints)."""
    try:
        return metadata.version("shardless")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _logging_options(p: argparse.ArgumentParser) -> None:
    """--log-level and --log-format: the top level's, and `run`'s, so that a TOML file may
    set them and they may follow `run` on its line."""
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help="this process's log level (Spark's own JVM log stays at WARN)",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="json: one JSON object per line (time, level, logger, message, exception)",
    )


def parser() -> argparse.ArgumentParser:
    """The `shardless` command's parser. Parse with `parse_args`, which also reads the
    environment and `run --config FILE`."""
    p = argparse.ArgumentParser(
        prog="shardless",
        description=__doc__.split("\n")[0],
        epilog="--log-level and --log-format may also be given after `run`, and set by "
        "SHARDLESS_LOG_LEVEL and SHARDLESS_LOG_FORMAT.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    _logging_options(p)
    settings.allow(p, config_file=False)
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

    run = sub.add_parser(
        "run",
        help="run an app file's process(event, ctx) over Kinesis",
        epilog=_SETTINGS_HELP,
    )
    run.add_argument("app_file")
    add_job_flags(run)
    sink = run.add_mutually_exclusive_group()
    sink.add_argument("--output", help="write outputs as Parquet here (default: console)")
    sink.add_argument(
        "--foreach-batch",
        metavar="MODULE:FUNCTION",
        help="call this function(df, batch) with each batch's outputs once its state is "
        "committed (instead of the app's foreach_batch, or the console)",
    )
    run.add_argument(
        "--master",
        help="Spark master (default: spark-submit's --master when launched by spark-submit, "
        "else local[2])",
    )
    when = run.add_mutually_exclusive_group()
    when.add_argument("--available-now", action="store_true", help="process what is there, stop")
    when.add_argument("--trigger", help="processing-time trigger, e.g. '5 seconds'")
    _logging_options(run)
    settings.allow(run, config_file=True)
    run.set_defaults(func=_run)

    produce = sub.add_parser("produce", help="put sample per-user events into a stream")
    produce.add_argument("--stream", required=True)
    produce.add_argument("--shards", type=int, default=4, help="if the stream must be created")
    produce.add_argument("--events", type=int, default=100_000)
    produce.add_argument("--users", type=int, default=5_000)
    produce.add_argument("--zipf", type=float, default=1.1, help="skew of user ids")
    produce.add_argument("--seed", type=int, default=7)
    produce.set_defaults(func=_produce)

    consumer = sub.add_parser("consumer", help="enhanced fan-out stream consumers")
    consumer_sub = consumer.add_subparsers(dest="action", required=True)
    dereg = consumer_sub.add_parser(
        "deregister",
        help="deregister an application's consumer from its streams (ends its subscriptions; "
        "a job with --consumer-name registers it again)",
    )
    dereg.add_argument("--stream", action="append", required=True, help="Kinesis stream (repeat)")
    dereg.add_argument("--consumer-name", required=True)
    dereg.add_argument("--kinesis-endpoint", help="Kinesis endpoint URL (default: boto3's)")
    dereg.set_defaults(func=_consumer_deregister)

    demo = sub.add_parser("demo", help="the end-to-end demo on local emulators")
    demo.set_defaults(func=_demo)
    state_cli.add_parser(sub)
    settings.show_defaults(p)
    return p


def parse_args(
    argv: list[str] | None = None, env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """The command's arguments: the command line's, then for what it leaves out the
    `SHARDLESS_*` variables of `env` (default: this process's), then `run --config FILE`'s.
    Raises ConfigError (an unknown key, a bad value, a required option given nowhere)."""
    argv = sys.argv[1:] if argv is None else argv
    top = parser()
    return settings.resolve(top, argv, top.parse_args(argv), os.environ if env is None else env)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (UTC, ISO 8601), level, logger,
    message, and exception (its traceback text) when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """This process's logging, in one place: `level` for shardless and the root logger (the
    AWS and py4j libraries stay at WARNING or above), as text or JSON lines on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def main(argv: list[str] | None = None) -> int:
    """Run the command; its exit code. A configuration error, from flags, variables or the
    file, prints one `shardless: ...` line and returns 2 before anything starts."""
    try:
        args = parse_args(argv)
    except ConfigError as exc:  # before anything starts
        print(f"shardless: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except (ProcessorError, ChangelogError, local_aws.LocalAwsError) as exc:
        print(f"shardless: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
