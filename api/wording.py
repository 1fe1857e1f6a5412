"""The planner's messages in the service's words: a message written for the command line names
its flags (`--split 3,9 covers 12 layers ...`); a client of the service sent JSON fields, so
each flag is named as the field of the request's `options` that carries it."""

from __future__ import annotations

import re

# command-line flag -> the field of PlanOptions it sets (as the client wrote it)
FLAG_FIELDS = {
    "split": "split", "replicas": "replicas", "recompute": "recompute", "tp": "tp",
    "microbatch-size": "microbatch_size", "microbatch-sizes": "microbatch_sizes",
    "global-batch": "global_batch", "schedule": "schedule", "method": "method",
    "objective": "objective", "optimizer": "optimizer", "time-limit": "time_limit_s",
    "powers-of-two": "powers_of_two", "seed": "seed", "max-tp": "max_tp",
    "no-recompute": "allow_recompute: false",
}
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)")


def in_api_words(message: str) -> str:
    """`message` with every known command-line flag named as the request field
    (`options.split`); other text, unknown flags included, as it was."""
    def field(m: re.Match[str]) -> str:
        name = FLAG_FIELDS.get(m.group(1))
        return f"options.{name}" if name else m.group(0)

    return _FLAG.sub(field, message)


SHOWN_ID = 64  # characters of an id a message repeats


def shown_id(value: str) -> str:
    """An id as a message repeats it: quoted, cut at SHOWN_ID characters (a 100 kB id in the
    URL was echoed whole in the 404)."""
    if len(value) <= SHOWN_ID:
        return repr(value)
    return f"{value[:SHOWN_ID]!r}... ({len(value)} characters)"
