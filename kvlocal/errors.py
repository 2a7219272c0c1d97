"""Errors that the command line turns into one line and exit code 2."""


class UsageError(Exception):
    """Bad input or setup that the user can fix; the message names the problem and the fix."""
