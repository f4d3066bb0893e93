"""`shardless run`'s job flags, made from `JobConfig`'s fields: `--field-name`, its type and
default from the field, its help and choices from the field's metadata. A new field gets
its flag, and a changed default reaches the command, with nothing restated; `settings`
makes from each flag its TOML key (`field_name`) and variable (`SHARDLESS_FIELD_NAME`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from shardless.processor.driver.config import JobConfig

# Fields whose flag is not simply --field-name taking one value.
_STREAMS = "streams"  # --stream NAME, repeated


def option(field: dataclasses.Field) -> str:
    return "--stream" if field.name == _STREAMS else "--" + field.name.replace("_", "-")


def add_job_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per JobConfig field. Fields without a default are required, except
    `checkpoint`, whose default the command computes from the application's name."""
    for f in dataclasses.fields(JobConfig):
        kw: dict[str, Any] = {"help": f.metadata["help"], "dest": f.name}
        if f.name == _STREAMS:
            kw.update(action="append", required=True, metavar="NAME")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw["required"] = f.name != "checkpoint"
        elif f.default_factory is not dataclasses.MISSING:
            kw["default"] = None  # the field's factory applies when the flag is not given
        elif isinstance(f.default, bool):
            kw["action"] = "store_true"
        else:
            kw["default"] = f.default
            if f.default is not None:
                kw["type"] = type(f.default)
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        parser.add_argument(option(f), **kw)


def job_config(args: argparse.Namespace, **given: Any) -> JobConfig:
    """The JobConfig the flags in `args` name; `given` fills fields the command computes
    (such as a default checkpoint). A flag left unset keeps the field's own default."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(JobConfig):
        value = getattr(args, f.name, None)
        if value is None and f.default is dataclasses.MISSING:
            continue  # a factory default, or one the caller gives
        values[f.name] = tuple(value) if f.name == _STREAMS else value
    return JobConfig(**{**values, **{k: v for k, v in given.items() if values.get(k) is None}})
