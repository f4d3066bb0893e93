"""`LogEncoder` writes `encode_log`'s bytes for every log it is given, and encodes a log
whole only when it does not continue the one before."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.changelog.layout import LogEntry, decode_log, encode_log
from shardless.changelog.log_encoder import LogEncoder, continues

PREFIXES = ("0123456789abcdef", "fedcba9876543210")


def uid(prefix: int, counter: int) -> str:
    """A uid as `new_uid` makes them (or, for prefix -1, a name that is not 32 hex digits)."""
    if prefix < 0:
        return f"uid-{counter}"
    return PREFIXES[prefix] + (counter % (1 << 64)).to_bytes(8, "big").hex()


entries = st.builds(
    LogEntry,
    version=st.integers(0, 10_000),
    batch=st.integers(0, 10_000),
    group=st.integers(0, 8),
    uid=st.builds(uid, st.integers(-1, 1), st.integers(0, (1 << 64) + 5)),
    offset=st.integers(0, 1 << 20),
    length=st.integers(0, 1 << 20),
    records=st.integers(0, 10_000),
    query=st.sampled_from(["", "q1", "q2"]),
)

# one batch's change to a log: entries added at its end, some dropped from its start, a
# copy of it (equal entries, other objects), or another log altogether
steps = st.one_of(
    st.tuples(st.just("add"), st.lists(entries, min_size=1, max_size=4)),
    st.tuples(st.just("drop"), st.integers(1, 40)),
    st.tuples(
        st.just("drop_and_add"),
        st.tuples(st.integers(1, 40), st.lists(entries, min_size=1, max_size=3)),
    ),
    st.tuples(st.just("copy"), st.none()),
    st.tuples(st.just("other"), st.lists(entries, max_size=6)),
    st.tuples(st.just("same"), st.none()),
)


def apply(log: tuple[LogEntry, ...], step: tuple) -> tuple[LogEntry, ...]:
    kind, arg = step
    if kind == "add":
        return log + tuple(arg)
    if kind == "drop":
        return log[min(arg, max(len(log) - 1, 0)) :]
    if kind == "drop_and_add":
        return log[min(arg[0], len(log)) :] + tuple(arg[1])
    if kind == "copy":
        return tuple(replace(e) for e in log)
    if kind == "other":
        return tuple(arg)
    return log


@settings(max_examples=300, deadline=None)
@given(st.lists(entries, max_size=40), st.lists(steps, max_size=25))
def test_every_log_is_encoded_as_encode_log_encodes_it(first, changes):
    encoder = LogEncoder()
    log = tuple(first)
    assert encoder.encode(log) == encode_log(log)
    for step in changes:
        log = apply(log, step)
        got = encoder.encode(log)
        assert got == encode_log(log), step
        assert decode_log(got) == log


def test_a_log_that_grows_at_its_end_and_is_cut_at_its_start_is_encoded_whole_once():
    """A slice's log over 200 batches: one entry a batch, the oldest 32 dropped at every
    snapshot past three (as `keep_snapshots` 3, `snapshot_every` 32 keep it)."""
    encoder = LogEncoder()
    log: tuple[LogEntry, ...] = ()
    for batch in range(200):
        entry = LogEntry(batch + 1, batch, 0, uid(0, 1000 + batch), 0, 10, 1, "q1")
        log = log + (entry,)
        if len(log) > 96:
            log = log[32:]
        assert encoder.encode(log) == encode_log(log)
    assert encoder.whole == 1
    # a log decoded again (equal entries, other objects) is encoded whole
    assert encoder.encode(decode_log(encode_log(log))) == encode_log(log)
    assert encoder.whole == 2


def test_continues_finds_the_entries_dropped_and_refuses_other_logs():
    a, b, c, d = (LogEntry(v, v, 0, uid(0, v), 0, 1, 1) for v in range(1, 5))
    assert continues((a, b, c), (a, b, c, d)) == 0
    assert continues((a, b, c), (c, d)) == 2
    assert continues((a, b, c), (b,)) is None  # c was dropped from the end
    assert continues((a, b, c), (a, c)) is None
    assert continues((a, b, c), (replace(a), b, c)) is None
    assert continues((), (a,)) is None
    assert continues((a,), ()) is None
