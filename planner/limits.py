"""The numbers the planner computes with: every file it reads and every request the service
takes is checked against these, so an absurd value gets a clear error naming its field instead
of an infinite prediction or a plan file that cannot be read back."""

from __future__ import annotations

import argparse
import math
from typing import Any

MAX_INT = 2**53  # 9 PB, 104 days in ms: beyond any real profile, and exact in a float
MAX_FLOAT = 1e15
# layers a plan command takes (PIPEPLAN_MAX_LAYERS, as the service): the search's tables grow
# with the square of the layers (20,000 layers took 11 GB and growing after 40 s)
DEFAULT_MAX_LAYERS = 5_000


def max_layers() -> int:
    import os

    try:
        return max(1, int(os.environ.get("PIPEPLAN_MAX_LAYERS", DEFAULT_MAX_LAYERS)))
    except ValueError:
        return DEFAULT_MAX_LAYERS


def _number(x: int | float) -> str:
    """`x` with every digit that tells it from a limit (`1e15` was printed for 1000000000000000.1)."""
    if isinstance(x, float):
        return repr(x)
    text = str(x)
    return text if len(text) <= 24 else f"a {len(text)}-digit integer"


def out_of_range(obj: Any, path: tuple[str | int, ...] = (), min_positive: float = 0.0
                 ) -> tuple[tuple[str | int, ...], str] | None:
    """The first number in a JSON document outside what the planner can compute with (an
    infinite or NaN float, a huge magnitude, or a positive number below `min_positive`), with
    the reason; None if all are fine."""
    if isinstance(obj, bool):
        return None
    if isinstance(obj, int | float):
        if isinstance(obj, float) and not math.isfinite(obj):
            return path, "numbers must be finite"
        limit = MAX_INT if isinstance(obj, int) else MAX_FLOAT
        if abs(obj) > limit:
            return path, f"{_number(obj)} is out of range (at most {limit:g} in magnitude)"
        if 0 < obj < min_positive:
            return path, f"{_number(obj)} is too small (at least {min_positive:g} when positive)"
        return None
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list | tuple):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        found = out_of_range(v, (*path, k), min_positive)
        if found is not None:
            return found
    return None


MIN_POSITIVE = 1e-6  # smallest bandwidth (GB/s), memory (GB), speed or efficiency a cluster may state


def small_divisor(doc: Any, path: tuple[str | int, ...] = (), least: float = MIN_POSITIVE
                  ) -> tuple[tuple[str | int, ...], str] | None:
    """The first divisor of a cluster description (a field named `*gb_per_s`, `*memory_gb`,
    `*efficiency` or `speed`) that is positive but below `least`, with the reason; None if none.
    Times are divided by these: 1e-300 made every prediction overflow. (Applied to every
    number, it refused a latency of 1e-7 us or a calibration's residual of 1e-9.) The service
    and the command line both check clusters with it."""
    items: Any = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        if key == "calibration":
            continue  # for people: the planner computes with none of it
        divisor = isinstance(key, str) and (key.endswith(("gb_per_s", "memory_gb", "efficiency")) or key == "speed")
        if divisor and isinstance(value, int | float) and not isinstance(value, bool):
            bad = out_of_range(value, (*path, key), min_positive=least)
        else:
            bad = small_divisor(value, (*path, key), least)
        if bad is not None:
            return bad
    return None


def field_path(path: tuple[str | int, ...]) -> str:
    """`layers.3.fwd_ms` for a path of `out_of_range`."""
    return ".".join(str(p) for p in path) or "(top level)"


# torch's CPU generator (mt19937) keeps 32 bits of a seed: 2**32 trained exactly as 0
MAX_RUN_SEED = 2**32 - 1


def run_seed_arg(text: str) -> int:
    """argparse type of the runtime's `--seed`: an integer from 0 to MAX_RUN_SEED."""
    value = seed_arg(text)
    if value > MAX_RUN_SEED:
        raise argparse.ArgumentTypeError(
            f"{text} is out of range: give a seed from 0 to {MAX_RUN_SEED} (torch's generator keeps "
            "32 bits of a seed, so larger ones repeat smaller ones' models and batches)")
    return value


def seed_arg(text: str) -> int:
    """argparse type of `--seed`: an integer from 0 to MAX_INT (the service's range; torch
    takes seeds below 2**64, and the runtime adds the step to it)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= MAX_INT:
        raise argparse.ArgumentTypeError(f"{text} is out of range: give a seed from 0 to {MAX_INT}")
    return value
