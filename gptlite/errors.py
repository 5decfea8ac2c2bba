"""The suite's one error for bad input: a leaf module, importable from every layer.

A ConfigError's message is one line naming the field (or file and key) and what is allowed; the
command lines print it and exit with code 2, with no traceback and nothing recorded.
"""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and what is allowed."""


def one_line(error: BaseException) -> str:
    """`Type: message` on one line, for an error raised by another library or the user's code
    (their messages often span several lines)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
