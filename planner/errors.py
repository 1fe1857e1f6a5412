"""User-facing errors: every message says what is wrong and what to do about it."""


class PipeplanError(Exception):
    """An error caused by the user's input (a file, a flag, a model); the CLI prints its
    message without a traceback and exits with status 2."""
