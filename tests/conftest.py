"""Shared fixtures: one set of local AWS emulators and one SparkSession per test run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator

import boto3
import pytest

from shardless.changelog import resources
from shardless.changelog.layout import AppLocation
from shardless.processor.local import emulators as local_aws


@pytest.fixture(scope="session")
def aws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_aws.LocalAws]:
    """moto server (S3, DynamoDB) and kinesalite on loopback, exported through the
    standard AWS_ENDPOINT_URL_* variables for this process and the Spark it starts."""
    started = local_aws.start("kinesalite", log_dir=tmp_path_factory.mktemp("local-aws"))
    try:
        with started.env_applied():
            yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def spark(aws: local_aws.LocalAws):  # noqa: ANN201
    from shardless.processor.driver.spark import session

    s = session("local[2]", groups=int(SUITE_GROUPS), app_name="shardless-tests", ui=False)
    yield s
    s.stop()


SUITE_GROUPS = "2"  # one per task slot of the suite's local[2]


@pytest.fixture(autouse=True)
def _suite_groups() -> Iterator[None]:
    """Put the session's group count back after each test: an in-process `shardless run
    --groups 4` sizes the one SparkSession for its job, which later tests would inherit."""
    yield
    if "pyspark" in sys.modules:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.conf.set("spark.sql.shuffle.partitions", SUITE_GROUPS)


@pytest.fixture(autouse=True)
def _close_slice_stores() -> Iterator[None]:
    """Close the stores that groups run in this process opened (`GroupRunner` in tests):
    each test's application gets its own cache, and open RocksDB files would otherwise
    pile up past the 1024 descriptors that py4j's select() can watch."""
    yield
    from shardless.processor.runtime.stores import close_caches

    close_caches()


@pytest.fixture
def clock_ahead(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], int]:
    """Move the wall clock of commits and leases `ms` ahead (a test that runs gc "hours
    later" commits at that time too); returns the shifted now in ms."""
    from shardless.changelog import durable, lease

    real = durable._now_ms

    def ahead(ms: int) -> int:
        shifted = lambda: real() + ms  # noqa: E731
        monkeypatch.setattr(durable, "_now_ms", shifted)
        monkeypatch.setattr(lease, "_now_ms", shifted)
        return shifted()

    return ahead


@pytest.fixture
def transfer_helper():  # noqa: ANN201
    """A new helper process (`shardless.changelog.transfer_process`), ready, stopped afterwards; the
    test points the module under test at it."""
    from shardless.changelog.transfer_process import TransferProcess

    tp = TransferProcess()
    assert tp.wait_ready(60)
    yield tp
    tp.stop()


@pytest.fixture
def helper(monkeypatch, transfer_helper):  # noqa: ANN001, ANN201
    """Every restore's transfers go to a new helper process."""
    from shardless.changelog import restore as restore_module

    monkeypatch.setattr(restore_module, "transfer_process", lambda: transfer_helper)
    return transfer_helper


@pytest.fixture
def location(aws: local_aws.LocalAws) -> AppLocation:
    """A fresh application (bucket, table, 16 slices) for one test."""
    loc = AppLocation.default(f"t-{uuid.uuid4().hex[:10]}")
    resources.ensure(loc, 16)
    return loc


@pytest.fixture
def kinesis(aws: local_aws.LocalAws):  # noqa: ANN201
    return boto3.client("kinesis")


@pytest.fixture
def make_stream(kinesis) -> Iterator[Callable[[int], str]]:  # noqa: ANN001
    """Create a stream with n shards and wait until it is ACTIVE; return its name. The
    streams are deleted after the test: the emulator allows 100 shards in all."""
    made: list[str] = []

    def make(shards: int = 2) -> str:
        name = f"s-{uuid.uuid4().hex[:10]}"
        kinesis.create_stream(StreamName=name, ShardCount=shards)
        made.append(name)
        for _ in range(200):
            if (
                kinesis.describe_stream_summary(StreamName=name)["StreamDescriptionSummary"][
                    "StreamStatus"
                ]
                == "ACTIVE"
            ):
                return name
            time.sleep(0.05)
        raise TimeoutError(f"stream {name} not ACTIVE")

    yield make
    for name in made:
        with contextlib.suppress(Exception):  # a test may have deleted it already
            kinesis.delete_stream(StreamName=name, EnforceConsumerDeletion=True)


_IN_PROCESS_MOTO = """
import os
os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1")
import boto3
from moto import mock_aws
from shardless.processor.local import moto_server
moto_server._patch()


def hash_table(ddb, name="t"):
    ddb.create_table(TableName=name, KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                     AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
                     BillingMode="PAY_PER_REQUEST")
"""


@pytest.fixture
def in_process_moto() -> Callable[[str], list[str]]:
    """Run a Python script in a subprocess whose moto runs in-process (`mock_aws`) with
    `shardless.processor.local.moto_server`'s fixes (they patch moto's modules, so not in this
    process); returns the words it printed. The script starts with `boto3`, `mock_aws`, fake
    credentials and `hash_table(ddb, name="t")` (a table keyed by `pk` alone) in place. The
    session's emulator endpoints are left out of its environment: a request sent to
    the session's server would find other tests' tables."""

    def run(script: str) -> list[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
        out = subprocess.run(
            [sys.executable, "-c", _IN_PROCESS_MOTO + textwrap.dedent(script)],
            capture_output=True, text=True, env=env, check=False, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.split()

    return run


@pytest.fixture
def sts(aws: local_aws.LocalAws, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """STS at the suite's moto server (`aws` exports S3's and DynamoDB's endpoints only); every
    role variable unset for shardless, and restored after the test."""
    from tests.jobs import ROLE_VARIABLES

    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", aws.s3_endpoint)
    for name in ROLE_VARIABLES:
        monkeypatch.setenv(name, "")
    return monkeypatch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files that hold slow tests first, each file still in one piece: `make test`
    spreads whole files over two workers (`--dist loadfile`), and a long file taken last
    would leave one worker running it alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order kept within
