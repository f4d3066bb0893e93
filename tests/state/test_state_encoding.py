"""Value encoding round-trips plain data and refuses anything else; store keys keep order."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from shardless.state import encoding
from shardless.state.encoding import MSGPACK, decode, encode
from shardless.state.errors import EncodingError
from shardless.state.keys import (
    DATA,
    IDENTITY_KEY,
    META,
    VERSION_KEY,
    data_key,
    data_keys,
    escape,
    is_data_key,
    record_key,
    unescape,
)

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)

plain_values = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)

# Text rich in NUL and bytes around it, where the key escaping could go wrong.
key_text = st.text() | st.text(alphabet="\x00\x01\xffa\u0100\U0001f600", max_size=8)


# --- values -----------------------------------------------------------------------------


@given(plain_values)
def test_encode_then_decode_round_trips_plain_values(value: object) -> None:
    raw = encode(value, key="k")
    assert raw[0] == MSGPACK
    back = decode(raw, key="k")
    assert back == value
    assert type(back) is type(value)


@given(plain_values)
def test_the_inlined_msgpack_halves_agree_with_encode_and_decode(value: object) -> None:
    """`shardless.processor.api.context` inlines `encode_msgpack` and `decode_msgpack`
    with these."""
    raw = encoding.MSGPACK_BYTE + encoding.pack_msgpack(value)
    assert raw == encode(value) == encoding.encode_msgpack(value, "k")
    assert encoding.unpack_msgpack(raw[1:]) == decode(raw) == encoding.decode_msgpack(raw, "k")


def test_encode_keeps_bytes_and_str_distinct() -> None:
    assert decode(encode(b"abc")) == b"abc"
    assert decode(encode("abc")) == "abc"
    assert decode(encode({"b": b"\x00", "s": "\x00"})) == {"b": b"\x00", "s": "\x00"}


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (object(), "object"),
        ({1, 2}, "set"),
        ({"nested": {1, 2}}, "dict"),
        (2**64, "int"),
        (-(2**63) - 1, "int"),
    ],
)
def test_encode_of_an_unsupported_value_names_the_key_and_the_type(
    value: object, type_name: str
) -> None:
    with pytest.raises(EncodingError) as info:
        encode(value, key="user:42")
    message = str(info.value)
    assert "'user:42'" in message
    assert type_name in message


def test_encode_refuses_a_value_over_the_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoding, "MAX_VALUE_BYTES", 100)
    assert decode(encode(b"x" * 90, key="small")) == b"x" * 90
    with pytest.raises(EncodingError) as info:
        encode(b"x" * 200, key="big-key")
    message = str(info.value)
    assert "'big-key'" in message
    assert "100" in message  # states the limit


def test_encode_at_exactly_the_size_limit_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    value = b"x" * 50
    size = len(msgpack.packb(value, use_bin_type=True))
    monkeypatch.setattr(encoding, "MAX_VALUE_BYTES", size)
    assert decode(encode(value)) == value
    monkeypatch.setattr(encoding, "MAX_VALUE_BYTES", size - 1)
    with pytest.raises(EncodingError):
        encode(value)


def test_decode_refuses_a_stored_value_over_the_size_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = encode(b"x" * 200)
    monkeypatch.setattr(encoding, "MAX_VALUE_BYTES", 100)
    with pytest.raises(EncodingError, match="'big'"):
        decode(raw, key="big")


@pytest.mark.parametrize("raw", [b"", b"\x00\xc0", b"\x02\xc0", b"\xff\x90", b"\x80"])
def test_decode_of_an_unknown_format_byte_raises_encoding_error(raw: bytes) -> None:
    with pytest.raises(EncodingError, match="'stored-key'"):
        decode(raw, key="stored-key")


@pytest.mark.parametrize(
    "raw",
    [
        b"\x01",  # no payload
        b"\x01\xc1",  # never-used msgpack byte
        b"\x01\x92\x01",  # array of two with one element
        b"\x01\x01\x02",  # trailing data
        b"\x01\xd9\x05ab",  # truncated str
        b"\x01\xa2\xff\xfe",  # str that is not UTF-8
    ],
)
def test_decode_of_garbage_raises_encoding_error(raw: bytes) -> None:
    with pytest.raises(EncodingError, match="'stored-key'"):
        decode(raw, key="stored-key")


@given(st.binary(max_size=64))
@example(b"\x81\x90\x00")  # a map whose key is an (unhashable) array
@example(b"\x81\x80\x00")  # a map whose key is an (unhashable) map
def test_decode_of_arbitrary_bytes_returns_or_raises_only_encoding_error(payload: bytes) -> None:
    with contextlib.suppress(EncodingError):
        decode(bytes((MSGPACK,)) + payload, key="k")


# --- keys -------------------------------------------------------------------------------


@given(key_text, key_text)
def test_data_key_preserves_the_order_of_utf8_bytes(a: str, b: str) -> None:
    assert (data_key(a) < data_key(b)) == (a.encode("utf-8") < b.encode("utf-8"))
    assert (data_key(a) == data_key(b)) == (a == b)


@given(key_text, key_text)
def test_data_keys_of_distinct_keys_are_prefix_free(a: str, b: str) -> None:
    if a != b:
        assert not data_key(b).startswith(data_key(a))
        assert not data_key(a).startswith(data_key(b))


def test_data_key_of_a_nul_extension_sorts_after_the_key_and_is_not_its_prefix() -> None:
    assert data_key("x") < data_key("x\x00") < data_key("x\x00\x00") < data_key("x\x01")
    assert not data_key("x\x00").startswith(data_key("x"))


@given(st.lists(key_text, max_size=20))
def test_data_keys_gives_each_distinct_keys_data_key_in_first_seen_order(
    record_keys: list[str],
) -> None:
    got = data_keys(record_keys)
    assert list(got) == list(dict.fromkeys(record_keys))
    assert got == {k: data_key(k) for k in record_keys}


@given(key_text)
def test_record_key_inverts_data_key(key: str) -> None:
    db_key = data_key(key)
    assert is_data_key(db_key)
    assert record_key(db_key) == key
    assert unescape(escape(key)) == key


@pytest.mark.parametrize("db_key", [VERSION_KEY, IDENTITY_KEY, b"", b"d", b"dabc", b"xabc\x00\x00"])
def test_record_key_rejects_keys_that_are_not_data_keys(db_key: bytes) -> None:
    with pytest.raises(ValueError, match="not a data key"):
        record_key(db_key)


@given(key_text)
def test_meta_keys_sort_before_every_data_key(key: str) -> None:
    for meta in (META, VERSION_KEY, IDENTITY_KEY):
        assert meta < data_key(key)
        assert not is_data_key(meta)
    assert data_key(key).startswith(DATA)
