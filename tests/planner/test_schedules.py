import itertools
import random

import pytest

from planner.actions import Action
from planner.schedules import generate, generate_rank
from planner.simulator import simulate
from planner.validate import validate
from tests.planner.helpers import equal_costs


def test_1f1b_order_matches_pipedream_flush() -> None:
    sched = generate("1f1b", [[0], [1], [2]], 4)
    assert [str(a) for a in sched[0]] == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    assert [str(a) for a in sched[2]] == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]
    gp = generate("gpipe", [[0], [1]], 3)
    assert [str(a) for a in gp[1]] == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_generate_rank_equals_generate() -> None:
    devs = [[0, 1], [2], [3, 4, 5]]
    full = generate("1f1b", devs, 7)
    for r in range(6):
        assert generate_rank("1f1b", devs, 7, r) == full[r]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_random_replicated_schedules_validate_and_finish(name: str) -> None:
    """Every generated schedule is valid and never deadlocks, whatever the replication."""
    rng = random.Random(0)
    for _ in range(150):
        S = rng.randint(1, 5)
        reps = [rng.randint(1, 4) for _ in range(S)]
        m = rng.randint(1, 12)
        ranks = itertools.count()
        devs = [[next(ranks) for _ in range(r)] for r in reps]
        sched = generate(name, devs, m)
        validate(sched, S, m)
        for s, ds in enumerate(devs):
            for k, d in enumerate(ds):
                mbs = [a.mb for a in sched[d] if a.kind == "F"]
                assert mbs == list(range(k, m, len(ds)))
                assert all(a.stage == s for a in sched[d])


def test_replicated_pipeline_runs_as_parallel_pipelines() -> None:
    """r identical replicas of every stage = r independent pipelines of m/r microbatches."""
    S, r, m = 6, 4, 32
    costs = equal_costs(S, m, 1.0, 2.0, replicas=r)
    sim = simulate(costs, generate("1f1b", costs.stage_devices, m))
    assert sim.iteration_ms == pytest.approx((m // r + S - 1) * 3.0)


def test_action_strings_roundtrip() -> None:
    assert Action.parse("12B7") == Action(12, "B", 7)
    assert str(Action(1, "F", 3)) == "1F3"
    with pytest.raises(ValueError):
        Action.parse("F3")
