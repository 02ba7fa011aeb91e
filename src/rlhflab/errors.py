"""Errors a user can fix from the command line."""


class ConfigError(ValueError):
    """Bad input. The message is one line: the config key or file, what is wrong, and the fix."""
