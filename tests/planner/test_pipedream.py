"""PipeDream's DP equals a brute-force search under the same objective (SOSP 2019, section 3.1)."""

import itertools
import math
import random

import numpy as np
import pytest

from planner.cost import OPTIMIZER_EXTRA_COPIES, transfer_ms
from planner.formats import GB
from planner.pipedream import DPInput, solve_flat, solve_hierarchical


def _compositions(n: int):
    """Every way to cut groups 0..n-1 into contiguous stages: lists of (first, last)."""
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            b = [0, *cuts, n]
            yield [(b[i], b[i + 1] - 1) for i in range(len(b) - 1)]


def _stage_time(inp: DPInput, i: int, j: int, r: int, used: int, units: int, extra: int, bw: float) -> float:
    comp = float(sum(inp.compute_ms[i:j + 1]))
    params = float(sum(inp.param_bytes[i:j + 1]))
    act = float(sum(inp.activation_bytes[i:j + 1]))
    sync = 0.0
    if r > 1 and params > 0:
        sync = (2 * (r - 1) / r * params / (bw * GB) * 1e3 + 2 * (r - 1) * inp.latency_us / 1e3) / inp.num_microbatches
    per = math.ceil(inp.num_microbatches / r)
    inflight = per if inp.schedule == "gpipe" else min(per, math.ceil((r + units - used + extra) / r))
    mem = params * (2 + OPTIMIZER_EXTRA_COPIES[inp.optimizer]) + act * inflight
    return comp / r + sync if mem <= inp.memory_limit_bytes else math.inf


def _brute_flat(inp: DPInput, lo: int, hi: int, units: int, extra: int, bw: float) -> float:
    best = math.inf
    n = hi - lo + 1
    for comp in _compositions(n):
        stages = [(lo + a, lo + b) for a, b in comp]
        for reps in itertools.product(range(1, units + 1), repeat=len(stages)):
            if sum(reps) > units:
                continue
            used, worst = 0, 0.0
            for q, ((i, j), r) in enumerate(zip(stages, reps, strict=True)):
                used += r
                worst = max(worst, _stage_time(inp, i, j, r, used, units, extra, bw))
                if q > 0:
                    worst = max(worst, 2 * transfer_ms(inp.cut_bytes[i - 1], bw, inp.latency_us) / r)
            best = min(best, worst)
    return best


def _random_input(rng: random.Random, n: int, memory_gb: float, schedule: str) -> DPInput:
    return DPInput(
        compute_ms=np.array([rng.uniform(0.5, 10) for _ in range(n)]),
        param_bytes=np.array([rng.choice([0, rng.uniform(1e6, 5e8)]) for _ in range(n)]),
        activation_bytes=np.array([rng.uniform(1e7, 5e8) for _ in range(n)]),
        cut_bytes=np.array([rng.uniform(1e6, 5e8) for _ in range(n - 1)]),
        num_microbatches=rng.choice([1, 4, 8]), memory_limit_bytes=memory_gb * GB,
        optimizer=rng.choice(["sgd", "adam"]), schedule=schedule, latency_us=rng.choice([0.0, 5.0]),
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_flat_dp_equals_brute_force(schedule: str) -> None:
    rng = random.Random(1)
    for _ in range(12):
        n, units = rng.randint(1, 6), rng.randint(1, 4)
        inp = _random_input(rng, n, rng.choice([2.0, 4.0, 100.0]), schedule)
        bw = rng.choice([1.0, 10.0, 100.0])
        res = solve_flat(inp, units, bw)
        want = _brute_flat(inp, 0, n - 1, units, 0, bw)
        assert res.objective_ms == pytest.approx(want, rel=1e-9)
        if math.isfinite(want):  # the returned pipeline achieves it and covers every group
            assert res.stages[0][0] == 0 and res.stages[-1][1] == n - 1
            assert sum(len(d) for _, _, d in res.stages) <= units


def test_hierarchical_dp_equals_brute_force() -> None:
    rng = random.Random(2)
    for _ in range(14):
        n, nodes, per_node = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 2)
        inp = _random_input(rng, n, rng.choice([1.0, 1.5, 3.0, 100.0]), "1f1b")
        intra, inter = 100.0, rng.choice([1.0, 10.0])
        extra = rng.choice([0, (nodes - 1) * per_node])
        res = solve_hierarchical(inp, nodes, per_node, intra, inter, extra)
        best1 = {(i, j): _brute_flat(inp, i, j, per_node, extra, intra)
                 for i in range(n) for j in range(i, n)}
        want = math.inf
        for comp in _compositions(n):
            for reps in itertools.product(range(1, nodes + 1), repeat=len(comp)):
                if sum(reps) > nodes:
                    continue
                worst = 0.0
                for q, ((i, j), r) in enumerate(zip(comp, reps, strict=True)):
                    params = float(sum(inp.param_bytes[i:j + 1])) / per_node
                    sync = 0.0
                    if r > 1 and params > 0:
                        sync = (2 * (r - 1) / r * params / (inter * GB) * 1e3
                                + 2 * (r - 1) * inp.latency_us / 1e3) / inp.num_microbatches
                    worst = max(worst, best1[(i, j)] / r + sync)
                    if q > 0:
                        worst = max(worst, 2 * transfer_ms(inp.cut_bytes[i - 1], inter, inp.latency_us) / r)
                want = min(want, worst)
        assert res.objective_ms == pytest.approx(want, rel=1e-9)
        if math.isfinite(want):
            devs = [d for _, _, ds in res.stages for d in ds]
            assert len(set(devs)) == len(devs) and max(devs) < nodes * per_node
