"""Directories of the user's own: the default local store directory and checkpoint
location, and the check that a directory holding state is private to this user."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from shardless.processor.errors import ConfigError

LOCAL_DIR_ENV = "SHARDLESS_LOCAL_DIR"


def _user_dir(env: str, fallback: str) -> Path:
    """`$env` if it is an absolute path (the XDG rule), else `~/<fallback>`; without a
    home, `<tmp>/shardless-<uid>/<fallback>` (checked like any other by `private_dir`)."""
    base = os.environ.get(env, "")
    if os.path.isabs(base):
        return Path(base)
    try:
        return Path.home() / fallback
    except (RuntimeError, KeyError):
        return Path(tempfile.gettempdir()) / f"shardless-{os.geteuid()}" / fallback


def user_cache_dir() -> Path:
    """The user's own `shardless` cache: `$XDG_CACHE_HOME/shardless` or `~/.cache/shardless`."""
    return _user_dir("XDG_CACHE_HOME", ".cache") / "shardless"


def user_state_dir() -> Path:
    """The user's own `shardless` state: `$XDG_STATE_HOME/shardless` or
    `~/.local/state/shardless`."""
    return _user_dir("XDG_STATE_HOME", ".local/state") / "shardless"


def default_local_dir() -> str:
    """`$SHARDLESS_LOCAL_DIR`, else `user_cache_dir()`."""
    return os.environ.get(LOCAL_DIR_ENV) or str(user_cache_dir())


def private_dir(path: str | Path, create: bool = True) -> Path:
    """`path`, made with mode 0o700 (and its missing parents) when missing and `create`.

    ConfigError when it exists but is not a directory, is owned by another user, or is
    writable by others: whoever can write there can plant or swap what is read back.
    """
    where = Path(path)
    if create and not os.path.lexists(where):
        try:
            where.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
        except OSError as exc:
            raise ConfigError(f"cannot create the directory {str(where)!r}: {exc}") from exc
        else:
            where.chmod(0o700)  # whatever the umask
    if not os.path.lexists(where):
        return where
    uid = os.geteuid()
    for st, what in ((os.lstat(where), "it"), (os.stat(where), "what it links to")):
        if st.st_uid != uid:
            raise ConfigError(
                f"directory {str(where)!r}: {what} is owned by uid {st.st_uid}, not by this "
                f"user (uid {uid}); refusing to keep state there: remove it or pick another"
            )
    st = os.stat(where)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{str(where)!r} is not a directory")
    if st.st_mode & stat.S_IWOTH:
        raise ConfigError(
            f"directory {str(where)!r} is writable by others (mode {stat.S_IMODE(st.st_mode):o});"
            f" refusing to keep state there: chmod o-w it (700 is best) or pick another"
        )
    return where
