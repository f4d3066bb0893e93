"""moto server, with fixes to its DynamoDB that make it behave like the service.

- Speed: moto 5.2 deep-copies a whole table once per *item* of a TransactWriteItems call,
  to roll back on failure; a 100-item transaction over a table of a few thousand items
  then takes seconds. This entry point copies only the items the transaction names
  (before it runs) and puts exactly those back if it fails: the same rollback, at a cost
  that does not grow with the table. Tables with a stream still get a whole copy, once
  per table per call, since a rollback must also take back their stream records.
  moto also parses each item's condition expression again for every place that checks
  it (three times per item: the request's validation, the transaction, the put); within
  one TransactWriteItems request an expression with the same names and values is parsed
  once, and the tokens of an expression string (which depend on nothing else) are kept
  for the next request that uses it.
- Isolation: moto's threaded server runs requests concurrently with no locking, so two
  conditional writes racing on one item can both pass their condition (seen with two
  committers racing). DynamoDB serialises them; here every DynamoDB operation takes one
  lock, which is what the service guarantees per item, and more.

Then it runs moto's own server unchanged: `python -m shardless.processor.local.moto_server -H
127.0.0.1 -p PORT`.
"""

from __future__ import annotations

import collections
import copy
import functools
import sys
import threading
from typing import Any

import moto.dynamodb.comparisons as ddb_comparisons
import moto.dynamodb.models as ddb_models
import moto.dynamodb.models.table as ddb_table
import moto.dynamodb.responses as ddb_responses
from moto.server import main as moto_main

_active = threading.local()


class _TransactionCopies:
    """Stands in for the `copy` module inside moto's DynamoDB models. During a transaction
    whose items were saved one by one (`_saved_items`), a table's "copy" is the table
    itself (moto's rollback then reassigns it to itself, and `_put_back` restores the
    items); otherwise a table is copied once per transaction."""

    def __getattr__(self, name: str) -> Any:
        return getattr(copy, name)

    def deepcopy(self, obj: Any, memo: dict | None = None) -> Any:
        cache = getattr(_active, "tables", None)
        if cache is None or not isinstance(obj, ddb_models.Table):
            return copy.deepcopy(obj, memo)
        if getattr(_active, "items_saved", False):
            return obj
        if id(obj) not in cache:  # the original is kept alive in the cache: ids stay unique
            cache[id(obj)] = (obj, copy.deepcopy(obj, memo))
        return cache[id(obj)][1]


_Saved = list[tuple[Any, Any, Any, Any]]  # (table, hash key, range key, item before or None)


def _saved_items(backend: Any, transact_items: list[dict[str, Any]]) -> _Saved | None:
    """A copy of every item the transaction names, as it is now (None where there is
    none); None when that cannot be worked out (a missing table or key, a table with a
    stream), and moto's whole-table copy is used instead."""
    saved: _Saved = []
    seen: set[tuple[int, Any, Any]] = set()
    try:
        for entry in transact_items:
            ((kind, op),) = entry.items()
            table = backend.tables.get(op["TableName"])
            if table is None or table.stream_shard is not None:
                return None
            key = op["Item"] if kind == "Put" else op["Key"]
            hash_key = ddb_models.DynamoType(key[table.hash_key_attr])
            range_key = (
                ddb_models.DynamoType(key[table.range_key_attr]) if table.has_range_key else None
            )
            if (id(table), hash_key, range_key) in seen:
                continue  # moto refuses the transaction before its second write of an item
            seen.add((id(table), hash_key, range_key))
            before = table.get_item(hash_key, range_key)
            saved.append((table, hash_key, range_key, copy.deepcopy(before)))
    except Exception:  # noqa: BLE001 - moto reports what is wrong with the request
        return None
    return saved


def _put_back(saved: _Saved) -> None:
    """Undo a failed transaction: every item it named is as it was before."""
    for table, hash_key, range_key, before in saved:
        if range_key is None:
            if before is None:
                table.items.pop(hash_key, None)
            else:
                table.items[hash_key] = before
            continue
        if before is not None:
            table.items[hash_key][range_key] = before
        elif hash_key in table.items:
            table.items[hash_key].pop(range_key, None)
            if not table.items[hash_key]:
                del table.items[hash_key]


def _parse(create: Any, expr: Any, names: Any, values: Any) -> tuple[Any, Any]:
    """(parser, parsed condition) of an expression, once per TransactWriteItems request for
    the same names and values (the request's own dicts, alive as long as the request; an
    empty or absent dict parses alike)."""
    cache = getattr(_active, "parsed", None)
    key = (expr, id(names) if names else None, id(values) if values else None)
    found = None if cache is None else cache.get(key)
    if found is None:
        parser = create(expr, names, values)
        found = (parser, parser.parse())
        if cache is not None:
            cache[key] = found
    return found


class _Parsed:
    """A parser that has parsed already: what the request's validation reads of it."""

    def __init__(self, parser: Any, op: Any) -> None:
        self._parser, self._op = parser, op

    def parse(self) -> Any:
        return self._op

    def __getattr__(self, name: str) -> Any:  # expr_attr_names_found, ...
        return getattr(self._parser, name)


def _parsed_once(create: Any) -> tuple[Any, Any]:
    """moto's `get_filter_expression` (for the backend) and `create_condition_expression_
    parser` (for the request's validation), sharing `_parse`'s cache."""

    def get_filter_expression(expr: Any, names: Any, values: Any) -> Any:
        return _parse(create, expr, names, values)[1]

    def create_condition_expression_parser(expr: Any, names: Any, values: Any) -> Any:
        if getattr(_active, "parsed", None) is None:
            return create(expr, names, values)
        return _Parsed(*_parse(create, expr, names, values))

    return get_filter_expression, create_condition_expression_parser


def _one_parse_per_request(handler: Any) -> Any:
    """A request handler with `_parse`'s cache open for the whole request (nested: kept)."""

    @functools.wraps(handler)
    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(_active, "parsed", None) is not None:
            return handler(*args, **kwargs)
        _active.parsed = {}
        try:
            return handler(*args, **kwargs)
        finally:
            _active.parsed = None

    return call


def _lexed_once(lex: Any) -> Any:
    """moto's condition lexer with its result kept per expression string. Its tokens are
    immutable leaves; every later pass builds new nodes and consumes its own deque."""

    @functools.lru_cache(maxsize=4096)
    def tokens(parser_class: Any, expression: str) -> tuple[Any, ...]:
        parser = parser_class.__new__(parser_class)
        parser.condition_expression = expression
        return tuple(lex(parser))

    def _lex_condition_expression(self: Any) -> Any:
        return collections.deque(tokens(type(self), self.condition_expression))

    return _lex_condition_expression


def _patch() -> None:
    backend = ddb_models.DynamoDBBackend
    original = backend.transact_write_items

    @_one_parse_per_request
    def transact_write_items(self: Any, transact_items: list[dict[str, Any]]) -> None:
        saved = _saved_items(self, transact_items)
        _active.tables, _active.items_saved = {}, saved is not None
        try:
            return original(self, transact_items)
        except Exception:
            if saved is not None:
                _put_back(saved)
            raise
        finally:
            _active.tables, _active.items_saved = None, False

    backend.transact_write_items = transact_write_items
    ddb_models.copy = _TransactionCopies()
    filter_expression, condition_parser = _parsed_once(
        ddb_comparisons.create_condition_expression_parser
    )
    for module in (ddb_models, ddb_table):
        module.get_filter_expression = filter_expression
    ddb_responses.create_condition_expression_parser = condition_parser
    handler = ddb_responses.DynamoHandler
    handler.transact_write_items = _one_parse_per_request(handler.transact_write_items)
    parser = ddb_comparisons.ConditionExpressionParser
    parser._lex_condition_expression = _lexed_once(parser._lex_condition_expression)
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
