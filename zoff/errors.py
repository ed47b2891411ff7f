"""The one exception type for bad user input: the CLI turns it into one line on stderr and exit code 2."""


class UserError(Exception):
    """Bad input from the user (config, CLI argument, checkpoint). The message names the key or file."""


class ConfigError(UserError):
    """A config key is unknown, mistyped or out of range."""
