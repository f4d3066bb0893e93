"""Inputs that must not reach S3, DynamoDB or the local disk unchecked: application names
and local directories."""

from __future__ import annotations

import pytest

from changelog.errors import ConfigurationError
from changelog.layout import AppLocation, check_app_name
from processor.config import JobConfig
from processor.errors import ConfigError

BAD_APPS = [
    "",
    ".",
    "..",
    "../x",
    "a/b",
    "Clicks",
    "clé",
    "点击",
    "a_b",
    "a.b",
    "a b",
    "-a",
    "a-",
    "x" * 54,
    "logs-s3alias",
    "logs--ol-s3",
    "logs--x-s3",
]
GOOD_APPS = ["a", "x", "app", "clicks", "t-0123abcd", "bench-commit-1024-99-123456789", "x" * 53]


@pytest.mark.parametrize("app", BAD_APPS)
def test_a_bad_application_name_is_refused_naming_it_and_the_rule(app):
    with pytest.raises(ConfigurationError) as raised:
        AppLocation.default(app)
    assert repr(app) in str(raised.value)
    assert "lower-case letters, digits and '-'" in str(raised.value)
    with pytest.raises(ConfigError, match="lower-case letters, digits and '-'"):
        JobConfig(app=app, streams=("s",), checkpoint="/tmp/c")


@pytest.mark.parametrize("app", GOOD_APPS)
def test_good_application_names_pass_and_make_a_valid_bucket(app):
    check_app_name(app)
    loc = AppLocation.default(app)
    assert 3 <= len(loc.bucket) <= 63 and loc.bucket == f"shardless-{app}"
    assert JobConfig(app=app, streams=("s",), checkpoint="/tmp/c").location.app == app
