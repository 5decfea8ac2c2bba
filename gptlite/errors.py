"""The suite's one error for bad input: a leaf module, importable from every layer.

A ConfigError's message is one line naming the field (or file and key) and what is allowed; the
command lines print it and exit with code 2, with no traceback and nothing recorded.
"""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and what is allowed."""
