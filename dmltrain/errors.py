"""The one exception type that reaches users as a single line instead of a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: a file, key or value that is wrong.

    The CLI prints ``dmltrain: error: <message>`` on one line and exits with
    ``exit_code`` (2 by default, as argparse does for usage errors). The message
    must name the file, key or value and say what is wrong with it.
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class ConfigError(UserError):
    """A configuration that cannot be used: unknown key, wrong type, impossible combination."""
