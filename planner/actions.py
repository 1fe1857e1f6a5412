"""Schedule actions: small hashable values whose one-line string form parses back.

`1F3` is stage 1's forward of microbatch 3, `0B7` stage 0's backward of microbatch 7
(the notation of PyTorch's pipelining schedules). Zero-bubble schedules split the backward:
`0B7` is then the gradient of the stage's inputs only and `0W7` the gradient of its weights
(always after its `B` on the same rank); a schedule without `W` actions runs the full backward
in `B`. A schedule is, for every rank, an ordered
list of actions; a replicated stage's replica k holds the microbatches j with j mod r == k.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_PATTERN = re.compile(r"^(\d+)([FBW])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: Literal["F", "B", "W"]
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        m = _PATTERN.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (expected e.g. '1F3', '0B7' or '0W7')")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))  # type: ignore[arg-type]


def parse_actions(texts: list[str]) -> list[Action]:
    return [Action.parse(t) for t in texts]
