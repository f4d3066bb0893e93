"""Errors raised by the processor: sources, handlers and the rest of `ProcessorError`.

A wrong configuration raises the project's one configuration error class,
`shardless.changelog.errors.ConfigurationError`, here under the name `ConfigError`: a
missing bucket and a bad flag are caught alike. Its message says what to change."""

from shardless.changelog.errors import ConfigurationError

ConfigError = ConfigurationError


class ProcessorError(Exception):
    """Base class for every error raised by `processor` (configuration errors aside)."""


class SourceError(ProcessorError):
    """The Kinesis source cannot continue (missing stream, lost position, ...)."""


class AppError(ProcessorError):
    """The user's app file cannot be loaded or does not define what a job needs."""
