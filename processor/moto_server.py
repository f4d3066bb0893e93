"""moto server, with two fixes to its DynamoDB that make it behave like the service.

- Speed: moto 5.2 deep-copies a whole table once per *item* of a TransactWriteItems call,
  to roll back on failure; a 100-item transaction over a table of a few thousand items
  then takes seconds. This entry point makes those copies once per table per call (the
  same rollback semantics).
- Isolation: moto's threaded server runs requests concurrently with no locking, so two
  conditional writes racing on one item can both pass their condition (seen with two
  committers racing). DynamoDB serialises them; here every DynamoDB operation takes one
  lock, which is what the service guarantees per item, and more.

Then it runs moto's own server unchanged: `python -m processor.moto_server -H 127.0.0.1
-p PORT`.
"""

from __future__ import annotations

import copy
import sys
import threading
from typing import Any

import moto.dynamodb.models as ddb_models
from moto.server import main as moto_main

_active = threading.local()


class _CopyOncePerTransaction:
    """Stands in for the `copy` module inside moto's DynamoDB models."""

    def __getattr__(self, name: str) -> Any:
        return getattr(copy, name)

    def deepcopy(self, obj: Any, memo: dict | None = None) -> Any:
        cache = getattr(_active, "cache", None)
        if cache is None or not isinstance(obj, ddb_models.Table):
            return copy.deepcopy(obj, memo)
        if id(obj) not in cache:  # the original is kept alive in the cache: ids stay unique
            cache[id(obj)] = (obj, copy.deepcopy(obj, memo))
        return cache[id(obj)][1]


def _patch() -> None:
    backend = ddb_models.DynamoDBBackend
    original = backend.transact_write_items

    def transact_write_items(self: Any, transact_items: list[dict[str, Any]]) -> None:
        _active.cache = {}
        try:
            return original(self, transact_items)
        finally:
            _active.cache = None

    backend.transact_write_items = transact_write_items
    ddb_models.copy = _CopyOncePerTransaction()
    for name in _SERIALISED:
        setattr(backend, name, _serialised(getattr(backend, name)))


_lock = threading.RLock()
_SERIALISED = (
    "batch_get_item",
    "batch_write_item",
    "delete_item",
    "execute_transaction",
    "get_item",
    "put_item",
    "query",
    "scan",
    "transact_get_items",
    "transact_write_items",
    "update_item",
)


def _serialised(method: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with _lock:
            return method(*args, **kwargs)

    return call


if __name__ == "__main__":
    _patch()
    sys.exit(moto_main(sys.argv[1:]))
