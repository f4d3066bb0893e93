"""The application's import record, as a job sees it: `shardless state import` writes it
(pk="app" sk="import") before it installs any slice and marks it "done" once every slice is
installed and verified. A job refuses an application whose import is not done (a half
imported state would look like a complete one), and the first state an import installed is
not records of any stream (a new checkpoint at its own starting position reads nothing
again)."""

from __future__ import annotations

from typing import Any

from shardless.changelog import aws
from shardless.changelog.layout import APP_PK, AppLocation, Head
from shardless.processor.errors import ConfigError

IMPORT_SK = "import"
QUERY_PREFIX = "import:"  # the query an import names in the heads it installs
DONE = "done"


def import_key() -> dict[str, Any]:
    return {"pk": {"S": APP_PK}, "sk": {"S": IMPORT_SK}}


def read_import(loc: AppLocation) -> dict[str, Any] | None:
    """The import record (query, status, at ms), or None when nothing was imported."""
    item = (
        aws.client("dynamodb")
        .get_item(TableName=loc.table, Key=import_key(), ConsistentRead=True)
        .get("Item")
    )
    if item is None:
        return None
    return {"query": item["query"]["S"], "status": item["status"]["S"], "at": int(item["at"]["N"])}


def installed_by_import(head: Head) -> bool:
    """Whether `head` is still the first state an import installed (no batch since)."""
    return head.batch < 0 and head.query.startswith(QUERY_PREFIX)


def check_import_done(loc: AppLocation) -> None:
    """ConfigError when an import into `loc` began and is not done."""
    found = read_import(loc)
    if found is not None and found["status"] != DONE:
        raise ConfigError(
            f"application {loc.app!r}: its import ({found['query']}) is {found['status']}, "
            "so its state may be incomplete and no job may run on it; run `shardless state "
            "import` again into a new application name (docs/operations.md, state import)"
        )
