"""Fixtures the Kinesis source's tests share."""

from __future__ import annotations

import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor.kinesis import reader
from shardless.processor.kinesis.batch_log import BatchLog


@pytest.fixture
def no_pacing(monkeypatch: pytest.MonkeyPatch) -> None:
    """GetRecords pacing is proven once (test_kinesis_reader.py); elsewhere it only slows the
    tests down."""
    monkeypatch.setattr(reader, "MIN_CALL_INTERVAL_S", 0)


@pytest.fixture
def batch_log(location: AppLocation) -> BatchLog:
    return BatchLog(location.table)
