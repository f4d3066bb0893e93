"""Options of the `shardless` command that may also come from the environment and from a
TOML file, and help that shows each option's default.

One source of truth: an option's TOML key is its argparse `dest` (for `shardless run`'s job
options, the `JobConfig` field: `snapshot_every`, also written `snapshot-every`, and the
flag's own name, such as `stream` for `--stream`), and its variable is `SHARDLESS_` and the
dest in capitals (`SHARDLESS_SNAPSHOT_EVERY`). A value from either is converted and checked by
the flag's own argparse `type` and `choices`. Precedence: the command line, then the
environment, then the `--config` file, then the option's default.

An option made settable here is not `required` to argparse (it may come from elsewhere): what
is still missing once every source is read is refused by `resolve`, as is an unknown key in
the file or a bad value anywhere, with a `ConfigError` naming the variable or the file and
key, and what is allowed.
"""

from __future__ import annotations

import argparse
import difflib
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardless.processor.errors import ConfigError

ENV_PREFIX = "SHARDLESS_"
CONFIG_ENV = "SHARDLESS_CONFIG"
_SPEC = "settings_spec"  # the namespace entry naming the command's Spec (see `allow`)
_SWITCH_WORDS = {
    "true": True, "1": True, "yes": True, "on": True,
    "false": False, "0": False, "no": False, "off": False,
}  # fmt: skip
_KINDS = {"int": "an integer", "float": "a number"}


def env_name(dest: str) -> str:
    """The variable that sets the option `dest`: `SHARDLESS_SNAPSHOT_EVERY`."""
    return ENV_PREFIX + dest.upper()


@dataclass(frozen=True)
class Spec:
    """One command's settable options: its parser, whether it reads `--config FILE`, and
    the options it needs from some source (argparse's `required`, moved here)."""

    parser: argparse.ArgumentParser
    config_file: bool
    required: tuple[str, ...]


def settable(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's options that the environment (and a file) may set: those with a value
    (`--help`, `--version` and `--config` aside)."""
    return [
        a
        for a in parser._actions
        if a.option_strings and a.default is not argparse.SUPPRESS and a.dest != "config"
    ]


def allow(parser: argparse.ArgumentParser, *, config_file: bool) -> None:
    """Let `SHARDLESS_*` variables (and, with `config_file`, a `--config FILE`) set the
    parser's options; call it once the parser has them all."""
    required = []
    for action in settable(parser):
        if action.required:
            action.required = False
            action.help = f"{action.help or ''} (required)".strip()
            required.append(action.dest)
    if config_file:
        parser.add_argument(
            "--config",
            metavar="FILE",
            help=f"TOML file of these options (or ${CONFIG_ENV}; see below)",
        )
        keys_of(parser)  # two options answering to one key fail here, not in a user's hands
    parser.set_defaults(**{_SPEC: Spec(parser, config_file, tuple(required))})


class DefaultsShown(argparse.HelpFormatter):
    """`--help` that ends each option's help with its default, unless it says it already
    (an option off by default, or without one, says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if shows_default(action) and "(default:" not in help:
            help = f"{help} (default: %(default)s)".strip()
        return help


def shows_default(action: argparse.Action) -> bool:
    """Whether `--help` states the option's default: it has one, and is not a switch."""
    return (
        bool(action.option_strings)
        and action.nargs != 0
        and action.default is not None
        and action.default is not argparse.SUPPRESS
    )


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """`DefaultsShown` for the parser and every subcommand's; an option with a default and
    no help gets one, so that its default is shown too."""
    parser.formatter_class = DefaultsShown
    for action in parser._actions:
        if action.help is None and shows_default(action):
            action.help = "(default: %(default)s)"
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)


def keys_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every TOML key the parser's settable options answer to: the dest and the long flag
    without its dashes, each with `_` or `-`."""
    keys: dict[str, argparse.Action] = {}
    for action in settable(parser):
        names = [action.dest] + [o[2:] for o in action.option_strings if o.startswith("--")]
        for key in {spelt for n in names for spelt in (n.replace("-", "_"), n.replace("_", "-"))}:
            if keys.setdefault(key, action) is not action:
                raise TypeError(f"TOML key {key!r} would name two options")
    return keys


def resolve(
    top: argparse.ArgumentParser,
    argv: Sequence[str],
    args: argparse.Namespace,
    env: Mapping[str, str],
) -> argparse.Namespace:
    """Fill `args` (`top.parse_args(argv)`'s) with the environment's and the file's values
    for every option the command line left out; `args.set_by` records where each came from."""
    spec: Spec = vars(args).pop(_SPEC)
    parsers = [top] if spec.parser is top else [top, spec.parser]
    every = [a for p in parsers for a in settable(p)]  # both define --log-level, for one
    actions = {a.dest: a for a in every}
    given = _given(top, argv, every)
    vars(args).update(given)  # the command line's own, not a subcommand's default over them
    sources = [_env_values(actions, env)]
    path = getattr(args, "config", None) or (env.get(CONFIG_ENV) if spec.config_file else None)
    if path:
        sources.append(_file_values(path, keys_of(spec.parser)))
    groups = [
        {a.dest for a in g._group_actions} for p in parsers for g in p._mutually_exclusive_groups
    ]
    args.set_by = {}
    for found in sources:
        values = {
            dest: (where, convert(actions[dest], raw, where))
            for dest, (where, raw) in found.items()
            if dest not in given and dest not in args.set_by
        }
        for group in groups:
            _exclusive(group, values, args, set(given) | set(args.set_by), actions)
        for dest, (where, value) in values.items():
            setattr(args, dest, value)
            args.set_by[dest] = where
    missing = [actions[d] for d in spec.required if getattr(args, d, None) is None]
    if missing:
        raise ConfigError(
            f"missing {', '.join(a.option_strings[0] for a in missing)}: give "
            f"{'it' if len(missing) == 1 else 'them'} on the command line, as "
            f"{' / '.join(env_name(a.dest) for a in missing)}, or in the --config file"
        )
    return args


def _given(
    top: argparse.ArgumentParser, argv: Sequence[str], actions: Iterable[argparse.Action]
) -> dict[str, Any]:
    """The options the command line gives, with their values: `argv` parsed again with no
    defaults. (The first parse has shown any help and refused any bad flag.)"""
    saved = [(a, a.default) for a in actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        seen = vars(top.parse_args(argv))
    finally:
        for action, default in saved:
            action.default = default
    return {a.dest: seen[a.dest] for a, _ in saved if a.dest in seen}


def _exclusive(
    group: set[str],
    values: dict[str, tuple[str, Any]],
    args: argparse.Namespace,
    set_before: set[str],
    actions: Mapping[str, argparse.Action],
) -> None:
    """Options that exclude each other (`--available-now`, `--trigger`): one turned on by a
    source drops the others' values from lower ones; one source may not turn on two."""

    def on(dest: str, value: Any) -> bool:
        return dest in actions and value != actions[dest].default

    mine = [d for d in sorted(group & values.keys()) if on(d, values[d][1])]
    if len(mine) > 1:
        raise ConfigError(f"{' and '.join(values[d][0] for d in mine)}: give only one")
    if any(d in set_before and on(d, getattr(args, d)) for d in group):
        for dest in group:
            values.pop(dest, None)


def _env_values(actions: Iterable[str], env: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """The options set in the environment, by dest: (variable, text). An empty variable
    counts as unset, as `SHARDLESS_LOCAL_DIR` always has."""
    return {
        dest: (env_name(dest), env[env_name(dest)]) for dest in actions if env.get(env_name(dest))
    }


def _file_values(path: str, keys: Mapping[str, argparse.Action]) -> dict[str, tuple[str, Any]]:
    """The options set in the TOML file at `path`, by dest: (where, raw value)."""
    try:
        with Path(path).open("rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from exc
    found: dict[str, tuple[str, Any]] = {}
    key_of: dict[str, str] = {}
    for key, value in table.items():
        action = keys.get(key)
        if action is None:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            known = sorted({a.dest for a in keys.values()})
            raise ConfigError(
                f"{path}: unknown key {key!r}{hint}; the keys are the options of this "
                f"command: {', '.join(known)}"
            )
        if action.dest in found:
            raise ConfigError(f"{path}: {key_of[action.dest]!r} and {key!r} set the same option")
        found[action.dest] = (f"{path}: {key}", value)
        key_of[action.dest] = key
    return found


def convert(action: argparse.Action, raw: Any, where: str) -> Any:
    """`raw` (a variable's text, or a TOML value) as the option's value, converted and
    checked by the flag's own type and choices. A repeated option takes a list (TOML) or
    comma-separated names (a variable); a switch takes true or false."""
    if action.nargs == 0:
        on = raw if isinstance(raw, bool) else _SWITCH_WORDS.get(str(raw).strip().lower())
        if on is None:
            raise ConfigError(f"{where}: {raw!r} is not true or false (or 1/0, yes/no, on/off)")
        return action.const if on else action.default
    if isinstance(action, argparse._AppendAction):
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list) or not [i for i in items if str(i).strip()]:
            raise ConfigError(f"{where}: {raw!r}: give one or more names (a list, or a,b,c)")
        return [_typed(action, _text(i, where).strip(), where) for i in items if str(i).strip()]
    return _typed(action, _text(raw, where), where)


def _text(raw: Any, where: str) -> str:
    """A TOML scalar as the text a flag would have been given."""
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ConfigError(f"{where}: {raw!r} is not a single value (a string or number)")
    return str(raw)


def _typed(action: argparse.Action, text: str, where: str) -> Any:
    """`text` through the flag's type and choices, as argparse would take it."""
    flag = action.option_strings[-1]
    try:
        value = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{where}: {text!r}: {exc} (the value of {flag})") from exc
    except (TypeError, ValueError) as exc:
        kind = getattr(action.type, "__name__", "")
        what = _KINDS.get(kind, f"a valid {kind} value")
        raise ConfigError(f"{where}: {text!r} is not {what} (the value of {flag})") from exc
    if action.choices is not None and value not in action.choices:
        allowed = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: {text!r} is not one of {allowed} (the value of {flag})")
    return value


def located(exc: ConfigError, set_by: Mapping[str, str]) -> ConfigError:
    """`exc` (a JobConfig check's, naming a flag or field) with where the value it names came
    from, when that is a variable or the file rather than the command line."""
    message = str(exc)
    for dest, where in set_by.items():
        flag = "--" + dest.replace("_", "-")  # or the field's name, when it is not one word
        names = [flag, dest] if "_" in dest else [flag]
        if any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", message) for n in names):
            return ConfigError(f"{message} [{dest} set by {where}]")
    return exc
