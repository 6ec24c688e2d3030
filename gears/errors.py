"""The one exception type for bad user input: its message names the problem and the fix."""


class GearsInputError(ValueError):
    """Raised for bad data, bad config or bad arguments. Entry points print it without a trace."""

    reported = False  # already printed (by rank 0, for an error that every rank raises)
    # Raised by every rank at once (they agreed on it): rank 0 prints it and the others wait
    # for that before they exit (gears.cli.launch.worker_main).
    every_rank = False


class DownloadError(GearsInputError):
    """A file could not be fetched or failed verification; the message says what to fetch where."""


class NonFiniteLossError(GearsInputError):
    """The training loss became NaN or infinite; the message names epoch, step and conditions."""


class TrainingStopped(Exception):
    """Training stopped on SIGTERM or SIGINT after rank 0 wrote a checkpoint; the entry points
    exit with status 0 (SIGTERM) or 130 (SIGINT, as a shell reports Ctrl-C) and
    `train.resume=true` continues from that checkpoint."""

    def __init__(self, message: str = "", signum: int = 15):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 130 if self.signum == 2 else 0
