"""A chosen key is read and routed the same way in the JVM plan (the job) and in Python
(the `TestDriver`, the state tools' `route`): the same key or the same reason for none,
and the same slice, so a key's state is where every tool looks for it."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardless.processor.api.context import Event
from shardless.processor.api.keys import KeyChoice, json_key
from shardless.processor.driver.keys import keyed
from shardless.processor.runtime.routing import route

SCHEMA = (
    "stream string, shard string, sequence_number string, subsequence long, "
    "partition_key string, explicit_hash_key string, arrival timestamp, data binary, slice int"
)
PATH = "user.id"
SLICES = (1, 16, 1000)

# The cases where JSON parsers are known to differ, each as Spark's parse_json reads it.
EDGES = [
    b'{"user": {"id": "u-1"}}',
    b'  {"user": {"id": "\\u00e9t\\u00e9"}} trailing text is ignored',
    b'{"user": {"id": "a", "id": "b"}}',  # a duplicate name: not JSON to Spark
    b'{"user": {"id": "\\ud800"}}',  # a lone surrogate
    b'{"user": {"id": "\\ud83d\\ude00"}}',  # a pair: one character
    b'{"user": {"id": NaN}}',
    b'{"user": {"id": 42}}',
    b'{"user": {"id": 1.5e300}}',
    b'{"user": {"id": true}}',
    b'{"user": {"id": null}}',
    b'{"user": {"id": {"x": 1}}}',
    b'{"user": {"id": [1]}}',
    b'{"user": "flat"}',
    b'{"user": {}}',
    b"{'user': {'id': 'single quotes'}}",
    b'\xef\xbb\xbf{"user": {"id": "bom"}}',
    b'{"user": {"id": "\xff"}}',
    b'{"user": {"id": "\xed\xa0\x80"}}',  # an encoded surrogate: not UTF-8
    b'{"user": {"id": ""}}',
    b"[]",
    b'"text"',
    b"",
    b"not json",
    b"0\x00",
    b' \t\r\n{"user": {"id": "after white space"}}',
    b'\x00{"user": {"id": "nul"}}',
    b'{"user": {"id": 1e400}}',
    b'{"user": {"id": "x"}} {"user": {"id": "y"}}',
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
records = st.one_of(
    st.builds(
        lambda id_, more: json.dumps({"user": {"id": id_, **more}}).encode(),
        json_values,
        st.dictionaries(st.sampled_from(["x", "y"]), json_values, max_size=2),
    ),
    st.builds(lambda v: json.dumps({"user": v}).encode(), json_values),
    st.builds(lambda t: json.dumps({"user": {"id": t}}, ensure_ascii=False).encode(), st.text()),
    st.sampled_from(EDGES),
    st.binary(max_size=12),
)


def _jvm(spark, datas: list[bytes], slices: int, choice: KeyChoice) -> list[tuple]:  # noqa: ANN001
    at = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [
        ("s", "shardId-0", str(i), 0, f"dev-{i % 5}", None, at, d, -1) for i, d in enumerate(datas)
    ]
    df = keyed(spark.createDataFrame(rows, SCHEMA), choice, slices)
    got = df.select("sequence_number", "key", "key_error", "slice").collect()
    return [(r.key, r.key_error, r.slice) for r in sorted(got, key=lambda r: int(r[0]))]


def _python(datas: list[bytes], slices: int, choice: KeyChoice) -> list[tuple]:
    out = []
    for i, d in enumerate(datas):
        at = datetime(2026, 1, 1, tzinfo=UTC)
        key, error = choice.of(Event("s", "shardId-0", str(i), 0, f"dev-{i % 5}", at, d))
        out.append((key, error, -1 if key is None else route(key, None, slices)))
    return out


@pytest.mark.slow
def test_the_known_edges_read_the_same_in_spark_and_python(spark) -> None:  # noqa: ANN001
    choice = KeyChoice(field=PATH)
    for slices in SLICES:
        assert _jvm(spark, EDGES, slices, choice) == _python(EDGES, slices, choice)
    assert json_key(EDGES[0], PATH) == ("u-1", None)
    assert json_key(EDGES[2], PATH) == (None, "its data is not UTF-8 JSON")
    assert json_key(EDGES[6], PATH) == (None, "its field 'user.id' is a number, not a string")
    assert json_key(EDGES[12], PATH) == (None, "it has no field 'user.id'")


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(datas=st.lists(records, min_size=1, max_size=40), slices=st.sampled_from(SLICES))
def test_a_field_path_key_and_its_slice_agree_between_spark_and_python(
    spark,  # noqa: ANN001
    datas: list[bytes],
    slices: int,
) -> None:
    choice = KeyChoice(field=PATH)
    assert _jvm(spark, datas, slices, choice) == _python(datas, slices, choice)


def user_of(record: Event) -> str:
    """A key function: the record's `user`, upper-cased; raises on a record without one."""
    return record.json()["user"].upper()


@pytest.mark.slow
def test_a_key_function_runs_before_the_shuffle_and_routes_by_its_md5(spark) -> None:  # noqa: ANN001
    choice = KeyChoice(function=user_of)
    datas = [json.dumps({"user": f"u{i}\ud800"}).encode() for i in range(20)]
    datas += [b'{"user": 7}', b"{}", b"\xff"]
    for slices in (16, 1000):
        got = _jvm(spark, datas, slices, choice)
        assert got == _python(datas, slices, choice)
    assert got[0][0] == "U0\ufffd"  # a lone surrogate reaches Spark as U+FFFD
    assert got[-3][1] == "key function user_of() raised AttributeError: 'int' object has no " \
        "attribute 'upper'"  # fmt: skip
    assert got[-2][1].startswith("key function user_of() raised KeyError")
