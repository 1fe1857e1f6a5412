"""User-facing errors: every message says what is wrong and what to do about it."""

from __future__ import annotations

import argparse
from typing import NoReturn


class PipeplanError(Exception):
    """An error caused by the user's input (a file, a flag, a model); the CLI prints its
    message without a traceback and exits with status 2."""


def first_line(text: str, most: int = 300) -> str:
    """The first line of an error message for a one-line report: at most `most` characters,
    cut after a whole word with an ellipsis where longer."""
    line = (text.strip().splitlines() or [""])[0]
    if len(line) <= most:
        return line
    return line[:most].rsplit(" ", 1)[0].rstrip(" ,;:") + " …"


def describe(exc: BaseException, most: int = 300) -> str:
    """The first line of `exc`'s message (`first_line`), or its type's name where it has none
    (an EOFError from an empty file: cutting its empty message was an IndexError)."""
    return first_line(str(exc), most) or type(exc).__name__


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line error for a bad option (exit status 2), as pipeplan's other
    errors: argparse printed the whole usage, a dozen lines, before the line that says what is
    wrong. `--help` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (--help lists the options)\n")
