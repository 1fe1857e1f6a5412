"""The learning rate of each step: `--lr-schedule constant|linear|cosine` after `--warmup-steps`.

The factors are those of Hugging Face transformers' `get_constant_schedule_with_warmup`,
`get_linear_schedule_with_warmup` and `get_cosine_schedule_with_warmup` (one half-cycle), as a
function of the run's global step (0-based: a resumed run continues where its checkpoint
stopped): warm-up rises linearly from 0 at step 0 to the full rate at step `warmup`; `linear`
and `cosine` then fall to 0 at step `decay` and stay there.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, schedule: str, warmup: int, decay: int) -> float:
    """The factor of the base learning rate at global step `step` (0-based)."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, decay - warmup))
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"learning-rate schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
