"""Errors raised by the processor: configuration, sources and handlers."""


class ProcessorError(Exception):
    """Base class for every error raised by `processor`."""


class ConfigError(ProcessorError):
    """The job's configuration is wrong; the message says what to change."""


class SourceError(ProcessorError):
    """The Kinesis source cannot continue (missing stream, lost position, ...)."""


class AppError(ProcessorError):
    """The user's app file cannot be loaded or does not define what a job needs."""
