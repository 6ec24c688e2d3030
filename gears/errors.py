"""The one exception type for bad user input: its message names the problem and the fix."""


class GearsInputError(ValueError):
    """Raised for bad data, bad config or bad arguments. Entry points print it without a trace."""


class DownloadError(GearsInputError):
    """A file could not be fetched or failed verification; the message says what to fetch where."""
