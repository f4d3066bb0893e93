"""Changelog segments: each slice's section round-trips and any damage is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardless.changelog.errors import CorruptObjectError
from shardless.changelog.segment import (
    OBJECT_MAGIC,
    SECTION_MAGIC,
    SectionRef,
    decode_index,
    decode_info,
    decode_section,
    encode_segment,
    index_length,
)

WHERE = "s3://bucket/app/seg-000042.shlg"

changes_st = st.lists(
    st.tuples(st.binary(max_size=12), st.none() | st.binary(max_size=24)),
    max_size=8,
)
sections_st = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=2**32 - 1),
        st.integers(min_value=0, max_value=2**64 - 1),
        changes_st,
    ),
    max_size=6,
)
info_st = st.dictionaries(
    st.text(max_size=8),
    st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text(max_size=16),
    max_size=5,
)


def _section(raw: bytes, ref: SectionRef) -> bytes:
    return raw[ref.offset : ref.offset + ref.length]


def _sample() -> tuple[bytes, list[SectionRef]]:
    return encode_segment(
        {"task": 3, "batch": 17},
        [
            (4, 9, [(b"d\x00a", b"\x01\x02"), (b"db", None)]),
            (5, 9, []),
            (6, 10, [(b"dc", b"")]),
        ],
    )


@given(info_st, sections_st)
def test_each_section_decodes_back_to_its_slices_changes(
    info: dict, sections: list[tuple[int, int, list[tuple[bytes, bytes | None]]]]
) -> None:
    raw, refs = encode_segment(info, sections)
    assert len(refs) == len(sections)
    end = None
    for ref, (slice_id, version, changes) in zip(refs, sections, strict=True):
        assert (ref.slice, ref.version, ref.records) == (slice_id, version, len(changes))
        if end is not None:
            assert ref.offset == end  # sections follow one another
        end = ref.offset + ref.length
        got = decode_section(_section(raw, ref), slice_id=slice_id, version=version, where=WHERE)
        assert got == changes
    assert end is None or end == len(raw)


@given(info_st, sections_st)
def test_decode_info_returns_the_segment_info(info: dict, sections: list) -> None:
    raw, _ = encode_segment(info, sections)
    assert decode_info(raw, where=WHERE) == info


@given(info_st, sections_st)
def test_the_index_names_every_section_where_it_is(info: dict, sections: list) -> None:
    raw, refs = encode_segment(info, sections)
    start = index_length(raw)
    assert start == (refs[0].offset if refs else len(raw))
    assert decode_index(raw[:start], where=WHERE) == refs
    for ref in decode_index(raw[:start], where=WHERE) or []:
        decode_section(_section(raw, ref), slice_id=ref.slice, version=ref.version, where=WHERE)


def _without_index(raw: bytes) -> bytes:
    """The same segment as written before segments had an index."""
    header_end = 4 + 1 + 4 + int.from_bytes(raw[5:9], "big") + 4
    return raw[:header_end] + raw[index_length(raw) :]


def test_a_segment_written_before_the_index_has_none_and_its_header_still_reads() -> None:
    raw, refs = _sample()
    old = _without_index(raw)
    assert old[index_length(old) : index_length(old) + 4] == SECTION_MAGIC
    assert decode_index(old, where=WHERE) is None
    assert decode_info(old, where=WHERE) == {"task": 3, "batch": 17}


@given(st.data())
def test_damage_to_the_index_is_refused(data: st.DataObject) -> None:
    raw, _ = _sample()
    header_end = 4 + 1 + 4 + int.from_bytes(raw[5:9], "big") + 4
    end = index_length(raw)
    position = data.draw(st.integers(min_value=header_end, max_value=end - 1))
    damaged = bytearray(raw[:end])
    damaged[position] ^= data.draw(st.integers(min_value=1, max_value=255))
    with pytest.raises(CorruptObjectError, match=WHERE):
        decode_index(bytes(damaged), where=WHERE)
    with pytest.raises(CorruptObjectError, match=WHERE):
        decode_index(raw[: data.draw(st.integers(min_value=header_end, max_value=end - 1))],
                     where=WHERE)  # fmt: skip


# magic, format, slice, version, length, crc32
SECTION_HEADER_SIZE = 4 + 1 + 4 + 8 + 4 + 4


@st.composite
def segment_and_flip(
    draw: st.DrawFn, payload_only: bool = False
) -> tuple[bytes, SectionRef, int, int]:
    sections = draw(
        st.lists(
            st.tuples(
                st.integers(min_value=0, max_value=1000),
                st.integers(min_value=0, max_value=1000),
                changes_st,
            ),
            min_size=1,
            max_size=4,
        )
    )
    raw, refs = encode_segment({"task": 1}, sections)
    ref = draw(st.sampled_from(refs))
    first = SECTION_HEADER_SIZE if payload_only else 0
    position = draw(st.integers(min_value=first, max_value=ref.length - 1))
    mask = draw(st.integers(min_value=1, max_value=255))
    return raw, ref, position, mask


@given(segment_and_flip())
def test_flipping_any_byte_of_a_section_is_refused(
    case: tuple[bytes, SectionRef, int, int],
) -> None:
    raw, ref, position, mask = case
    section = bytearray(_section(raw, ref))
    section[position] ^= mask
    with pytest.raises(CorruptObjectError, match=WHERE):
        decode_section(bytes(section), slice_id=ref.slice, version=ref.version, where=WHERE)


@given(segment_and_flip(payload_only=True))
def test_flipping_any_byte_of_a_section_payload_fails_the_checksum(
    case: tuple[bytes, SectionRef, int, int],
) -> None:
    raw, ref, position, mask = case
    section = bytearray(_section(raw, ref))
    section[position] ^= mask
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode_section(bytes(section), slice_id=ref.slice, version=ref.version, where=WHERE)


def test_an_empty_section_is_a_header_and_an_empty_msgpack_list() -> None:
    raw, refs = _sample()
    assert refs[1].length == SECTION_HEADER_SIZE + 1
    assert _section(raw, refs[1])[SECTION_HEADER_SIZE:] == b"\x90"


def test_a_section_payload_is_the_documented_msgpack_of_key_value_pairs() -> None:
    """The bytes segments already in S3 hold: an array of [key, value-or-nil] arrays, keys
    and values as msgpack bin (the encoder packs the changes' tuples as they are)."""
    raw, refs = _sample()
    first = _section(raw, refs[0])[SECTION_HEADER_SIZE:]
    assert first == b"\x92\x92\xc4\x03d\x00a\xc4\x02\x01\x02\x92\xc4\x02db\xc0"
    assert _section(raw, refs[2])[SECTION_HEADER_SIZE:] == b"\x91\x92\xc4\x02dc\xc4\x00"


def test_a_section_asked_for_with_the_wrong_slice_is_refused_naming_both() -> None:
    raw, refs = _sample()
    ref = refs[0]
    with pytest.raises(CorruptObjectError) as info:
        decode_section(_section(raw, ref), slice_id=5, version=9, where=WHERE)
    message = str(info.value)
    assert WHERE in message
    assert "slice 4 version 9" in message
    assert "expected slice 5 version 9" in message


def test_a_section_asked_for_with_the_wrong_version_is_refused_naming_both() -> None:
    raw, refs = _sample()
    ref = refs[2]
    with pytest.raises(CorruptObjectError) as info:
        decode_section(_section(raw, ref), slice_id=6, version=11, where=WHERE)
    message = str(info.value)
    assert WHERE in message
    assert "slice 6 version 10" in message
    assert "expected slice 6 version 11" in message


def test_a_neighbouring_sections_bytes_are_refused() -> None:
    raw, refs = _sample()
    with pytest.raises(CorruptObjectError, match="slice 5"):
        decode_section(_section(raw, refs[1]), slice_id=4, version=9, where=WHERE)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_truncated_section_is_refused(index: int) -> None:
    raw, refs = _sample()
    section = _section(raw, refs[index])
    for cut in range(len(section)):
        with pytest.raises(CorruptObjectError, match=WHERE):
            decode_section(
                section[:cut], slice_id=refs[index].slice, version=refs[index].version, where=WHERE
            )


def test_a_section_with_trailing_bytes_is_refused() -> None:
    raw, refs = _sample()
    with pytest.raises(CorruptObjectError, match=WHERE):
        decode_section(_section(raw, refs[0]) + b"\x00", slice_id=4, version=9, where=WHERE)


def test_a_truncated_segment_header_is_refused() -> None:
    raw, _ = _sample()
    header_end = 4 + 1 + 4 + int.from_bytes(raw[5:9], "big") + 4
    for cut in range(header_end):
        with pytest.raises(CorruptObjectError, match=WHERE):
            decode_info(raw[:cut], where=WHERE)


def test_a_section_with_the_wrong_magic_is_refused() -> None:
    raw, refs = _sample()
    section = _section(raw, refs[0])
    assert section.startswith(SECTION_MAGIC)
    with pytest.raises(CorruptObjectError, match="magic") as info:
        decode_section(b"XXXX" + section[4:], slice_id=4, version=9, where=WHERE)
    assert WHERE in str(info.value)


def test_a_segment_with_the_wrong_magic_is_refused() -> None:
    raw, _ = _sample()
    assert raw.startswith(OBJECT_MAGIC)
    with pytest.raises(CorruptObjectError, match="magic") as info:
        decode_info(b"XXXX" + raw[4:], where=WHERE)
    assert WHERE in str(info.value)


def test_a_whole_segment_is_not_mistaken_for_a_section() -> None:
    raw, _ = _sample()
    with pytest.raises(CorruptObjectError, match="magic"):
        decode_section(raw, slice_id=4, version=9, where=WHERE)


def test_an_unsupported_format_is_refused() -> None:
    raw, refs = _sample()
    section = bytearray(_section(raw, refs[0]))
    section[4] = 2
    with pytest.raises(CorruptObjectError, match="format 2"):
        decode_section(bytes(section), slice_id=4, version=9, where=WHERE)
    header = bytearray(raw)
    header[4] = 2
    with pytest.raises(CorruptObjectError, match="format 2"):
        decode_info(bytes(header), where=WHERE)


def test_a_damaged_segment_header_fails_its_checksum() -> None:
    raw, refs = _sample()
    damaged = bytearray(raw)
    damaged[10] ^= 0x01  # inside the msgpack info
    with pytest.raises(CorruptObjectError, match="checksum") as info:
        decode_info(bytes(damaged), where=WHERE)
    assert WHERE in str(info.value)
