"""Errors raised by the local state engine."""


class StateError(Exception):
    """Base class for every error raised by `state`."""


class EncodingError(StateError):
    """A value could not be encoded or decoded."""


class CorruptStoreError(StateError):
    """A local store is unreadable or belongs to something else; it must be rebuilt."""
