"""The one exception type for bad user input: the CLI turns it into one line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input from the user (config, CLI argument, checkpoint). The message names the key or file."""

    def __init__(self, message: object = "") -> None:
        # Always one line, whatever it quotes (a key or a path with a newline in it).
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"))


class ConfigError(UserError):
    """A config key is unknown, mistyped or out of range."""


def os_error(cause: OSError, message: str) -> OSError:
    """An OSError that reads as its one-line message (no "[Errno N]" prefix) and keeps the cause's errno:
    what an I/O path raises so that the caller's one-line error can quote it."""
    err = OSError(message)
    err.errno = cause.errno
    return err
