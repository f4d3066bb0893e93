"""Errors raised by the durability layer. Messages name the object and what to do."""


class ChangelogError(Exception):
    """Base class for every error raised by `changelog`."""


class ConfigurationError(ChangelogError):
    """The configuration is wrong (a flag, a name) or the durable resources it names are
    missing, unreachable or belong to a different setup. The project's one configuration
    error class (`shardless.processor.errors.ConfigError` is this class)."""


class CorruptObjectError(ChangelogError):
    """A durable object failed its magic, format or checksum check; it is never loaded."""


class CommitConflictError(ChangelogError):
    """A conditional commit lost: another attempt or query committed this slice first."""


class ContinuityError(ChangelogError):
    """The commit log of a slice has a gap; restore refuses rather than guess."""


class MissingObjectError(ChangelogError):
    """An object that committed state references is gone from the bucket."""


class ThrottledError(ChangelogError):
    """DynamoDB kept refusing part of a request for lack of capacity, past every retry."""


class CommitTooLateError(ChangelogError):
    """A commit would have referenced uploads older than its deadline, which garbage
    collection beside a running job may already have removed; the attempt is retried."""
