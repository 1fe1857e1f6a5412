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
