"""The driver's hold on its application's lease while a query runs (`shardless.changelog.lease`).

A daemon thread renews the lease every `ttl_s / 3` seconds while the query is active and
releases it within about a second of the query stopping; a driver that dies simply stops
renewing, and the lease lapses `ttl_s` seconds later. Renewal failures are logged and
retried: the lease only informs the state tools, it never stops the job.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any

from shardless.changelog import lease
from shardless.changelog.durable import owner_name
from shardless.changelog.layout import AppLocation

log = logging.getLogger(__name__)


def hold(loc: AppLocation, query: Any, ttl_s: float = lease.DEFAULT_TTL_S) -> threading.Thread:
    """Hold `loc`'s lease while the StreamingQuery `query` is active."""
    owner = owner_name()
    query_id = str(query.id)
    stop = threading.Event()

    def beat() -> None:
        due = 0.0
        while not stop.is_set():
            try:
                if not query.isActive:
                    break
                if time.monotonic() >= due:
                    lease.renew(loc, owner, query_id, ttl_s)
                    due = time.monotonic() + ttl_s / 3
            except Exception as exc:  # noqa: BLE001 - advisory; logged and retried
                log.warning("could not renew the lease of %s: %s", loc.app, exc)
            stop.wait(1.0)  # a stopped query lets go within about a second
        try:
            lease.release(loc, owner)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not release the lease of %s: %s", loc.app, exc)

    thread = threading.Thread(target=beat, name=f"shardless-lease-{loc.app}", daemon=True)
    thread.stop = stop  # type: ignore[attr-defined]
    thread.start()

    def let_go() -> None:  # a driver that exits normally releases at once
        stop.set()
        thread.join(timeout=10)

    atexit.register(let_go)
    return thread
