"""Shared helpers of the runtime tests: plans over a model's traced layers, and running
`python -m runtime` (the launcher runs in the test process; the ranks are real processes)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from plans import make_plan, traced_layers, write_plan  # noqa: E402,F401
from runtime_paths import EXAMPLES, MODELS  # noqa: E402,F401

from runtime.cli import main  # noqa: E402


def split_evenly(n: int, stages_: int) -> list[int]:
    return [n // stages_ + (1 if i < n % stages_ else 0) for i in range(stages_)]


class Runner:
    def __init__(self, tmp: Path, capfd: pytest.CaptureFixture[str]) -> None:
        self.tmp, self.capfd = tmp, capfd

    def plan(self, model: str | Path, split: list[int] | int, replicas: list[int] | None = None,
             name: str = "plan.json", **kw: object) -> Path:
        layers = traced_layers(model, int(kw.get("microbatch_size", 2)))  # type: ignore[arg-type]
        if isinstance(split, int):
            split = split_evenly(len(layers), split)
        plan = make_plan(model, layers, split, replicas or [1] * len(split), **kw)  # type: ignore[arg-type]
        return write_plan(plan, self.tmp / name)

    def __call__(self, *argv: str | Path) -> tuple[int, str, str, float]:
        self.capfd.readouterr()
        t0 = time.time()
        rc = main([str(a) for a in argv])
        out, err = self.capfd.readouterr()
        return rc, out, err, time.time() - t0


@pytest.fixture
def run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> Runner:
    return Runner(tmp_path, capfd)
