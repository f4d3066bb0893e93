"""Layout of keys inside a slice's RocksDB store.

User entries live under `b"d"` with an order-preserving, prefix-free encoding of the
record key, so that a key's entries are contiguous and different keys never share a
prefix. Engine metadata lives under `b"\\x00"` and sorts before every user entry.
"""

DATA = b"d"
META = b"\x00m/"
VERSION_KEY = META + b"version"
IDENTITY_KEY = META + b"identity"

_TERMINATOR = b"\x00\x00"


def escape(key: str) -> bytes:
    """UTF-8 with NUL escaped as NUL 0xFF, so the terminator NUL NUL cannot occur inside."""
    return key.encode("utf-8").replace(b"\x00", b"\x00\xff")


def unescape(raw: bytes) -> str:
    return raw.replace(b"\x00\xff", b"\x00").decode("utf-8")


def data_key(key: str) -> bytes:
    """The store key of a record key's value."""
    return DATA + escape(key) + _TERMINATOR


def record_key(db_key: bytes) -> str:
    """Inverse of `data_key`."""
    if not db_key.startswith(DATA) or not db_key.endswith(_TERMINATOR):
        raise ValueError(f"not a data key: {db_key!r}")
    return unescape(db_key[len(DATA) : -len(_TERMINATOR)])


def is_data_key(db_key: bytes) -> bool:
    return db_key.startswith(DATA)
