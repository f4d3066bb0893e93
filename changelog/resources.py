"""Create (or check) an application's bucket, table and metadata before any work runs."""

from __future__ import annotations

import time
from typing import Any

from botocore.exceptions import ClientError, EndpointConnectionError

from shardless.changelog import aws
from shardless.changelog.errors import ConfigurationError
from shardless.changelog.layout import APP_PK, FORMAT, META_SK, AppLocation

_DENIED = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "403"}


def ensure(loc: AppLocation, slices: int) -> None:
    """Make sure the bucket and table exist and the application's slice count matches.

    Fails fast with a message that says what to fix: an unreachable endpoint, missing
    permissions, or existing state kept in a different number of slices.
    """
    try:
        _ensure_bucket(loc)
        _ensure_table(loc)
        _ensure_meta(loc, slices)
    except EndpointConnectionError as exc:
        raise ConfigurationError(
            f"cannot reach {exc.kwargs.get('endpoint_url', 'the AWS endpoint')}: start the local "
            "emulators (`shardless local up`) or fix AWS_ENDPOINT_URL_S3 / "
            "AWS_ENDPOINT_URL_DYNAMODB"
        ) from exc


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _ensure_bucket(loc: AppLocation) -> None:
    s3 = aws.client("s3", fail_fast=True)
    try:
        s3.head_bucket(Bucket=loc.bucket)
        return
    except ClientError as exc:
        if _code(exc) in _DENIED:
            raise ConfigurationError(
                f"no access to bucket s3://{loc.bucket} at {aws.where('s3')}: grant "
                f"s3:ListBucket, s3:GetObject, s3:PutObject on it"
            ) from exc
        if _code(exc) not in {"404", "NoSuchBucket", "NotFound"}:
            raise
    try:
        s3.create_bucket(Bucket=loc.bucket)
    except ClientError as exc:
        if _code(exc) in _DENIED:
            raise ConfigurationError(
                f"bucket s3://{loc.bucket} does not exist and this role may not create it: "
                "create it, or grant s3:CreateBucket"
            ) from exc
        if _code(exc) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
            raise


# An application's table: string keys `pk` and `sk` (`shardless.changelog.layout`), on demand.
TABLE_SCHEMA: dict[str, Any] = {
    "KeySchema": [
        {"AttributeName": "pk", "KeyType": "HASH"},
        {"AttributeName": "sk", "KeyType": "RANGE"},
    ],
    "AttributeDefinitions": [
        {"AttributeName": "pk", "AttributeType": "S"},
        {"AttributeName": "sk", "AttributeType": "S"},
    ],
    "BillingMode": "PAY_PER_REQUEST",
}


def _ensure_table(loc: AppLocation) -> None:
    ddb = aws.client("dynamodb", fail_fast=True)
    try:
        status = ddb.describe_table(TableName=loc.table)["Table"]["TableStatus"]
    except ClientError as exc:
        if _code(exc) in _DENIED:
            raise ConfigurationError(
                f"no access to DynamoDB table {loc.table} at {aws.where('dynamodb')}: grant "
                "dynamodb:DescribeTable, GetItem, BatchGetItem, Query, PutItem, UpdateItem, "
                "TransactWriteItems on it"
            ) from exc
        if _code(exc) != "ResourceNotFoundException":
            raise
        try:
            ddb.create_table(TableName=loc.table, **TABLE_SCHEMA)
        except ClientError as exc2:
            if _code(exc2) in _DENIED:
                raise ConfigurationError(
                    f"DynamoDB table {loc.table} does not exist and this role may not create "
                    "it: create it (keys pk, sk: strings) or grant dynamodb:CreateTable"
                ) from exc2
            if _code(exc2) != "ResourceInUseException":
                raise
        status = "CREATING"
    deadline = time.monotonic() + 120
    while status != "ACTIVE":
        if time.monotonic() > deadline:
            raise ConfigurationError(f"DynamoDB table {loc.table} is not ACTIVE after 120 s")
        time.sleep(0.2)
        status = ddb.describe_table(TableName=loc.table)["Table"]["TableStatus"]


def _ensure_meta(loc: AppLocation, slices: int) -> None:
    ddb = aws.client("dynamodb", fail_fast=True)
    item = {
        "pk": {"S": APP_PK},
        "sk": {"S": META_SK},
        "slices": {"N": str(slices)},
        "format": {"N": str(FORMAT)},
        "created_at": {"N": str(int(time.time()))},
    }
    try:
        ddb.put_item(TableName=loc.table, Item=item, ConditionExpression="attribute_not_exists(pk)")
        return
    except ClientError as exc:
        if _code(exc) != "ConditionalCheckFailedException":
            raise
    found = ddb.get_item(
        TableName=loc.table, Key={"pk": {"S": APP_PK}, "sk": {"S": META_SK}}, ConsistentRead=True
    )["Item"]
    existing = int(found["slices"]["N"])
    if existing != slices:
        raise ConfigurationError(
            f"application {loc.app!r} keeps its state in {existing} slices, but the job is "
            f"configured with {slices}: run with --slices {existing}, or start a new application "
            "name to begin from empty state"
        )


def app_slices(loc: AppLocation) -> int:
    """The slice count an existing application's state was written with."""
    ddb = aws.client("dynamodb", fail_fast=True)
    try:
        found = ddb.get_item(
            TableName=loc.table,
            Key={"pk": {"S": APP_PK}, "sk": {"S": META_SK}},
            ConsistentRead=True,
        ).get("Item")
    except ClientError as exc:
        if _code(exc) == "ResourceNotFoundException":
            raise ConfigurationError(
                f"application {loc.app!r} has no state: table {loc.table} does not exist "
                f"(at {aws.where('dynamodb')})"
            ) from exc
        raise
    if found is None:
        raise ConfigurationError(
            f"application {loc.app!r} has no state: table {loc.table} has no app record"
        )
    return int(found["slices"]["N"])
