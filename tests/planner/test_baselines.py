import itertools
import random

import pytest

from planner.baselines import (
    _split_longest,
    block_partition,
    partition_balanced,
    partition_uniform,
    solve_uniform,
)
from planner.errors import PipeplanError
from planner.formats import PlanOptions
from planner.solve import make_plan
from tests.planner.helpers import chain_profile, cluster


def _sums(weights: list[float], bounds: list[int]) -> list[float]:
    return [sum(weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def test_uniform_matches_deepspeed() -> None:
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(8, 8) == list(range(9))


def test_balanced_is_the_optimal_min_max_split() -> None:
    rng = random.Random(3)
    for _ in range(60):
        n = rng.randint(1, 9)
        S = rng.randint(1, n)
        w = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(n)]
        bounds = partition_balanced(w, S)
        assert len(bounds) == S + 1 and all(b > a for a, b in zip(bounds, bounds[1:], strict=False))
        best = min(max(_sums(w, [0, *c, n])) for c in itertools.combinations(range(1, n), S - 1))
        assert max(_sums(w, bounds)) == pytest.approx(best, abs=1e-6)


def test_splitting_the_longest_stages_is_the_rule_applied_step_by_step() -> None:
    """`_split_longest` (a heap) gives what rescanning the list for the first longest stage,
    and splitting its first layer off, gives each time (the rule as it was written first)."""
    def rule(bounds: list[int], S: int) -> list[int] | None:
        bounds = list(bounds)
        while len(bounds) - 1 < S:
            k = max(range(len(bounds) - 1), key=lambda s: bounds[s + 1] - bounds[s])
            if bounds[k + 1] - bounds[k] < 2:
                return None
            bounds.insert(k + 1, bounds[k] + 1)
        return bounds

    rng = random.Random(5)
    for _ in range(3000):
        n = rng.randint(1, 30)
        k = rng.randint(1, n)
        bounds = [0, *sorted(rng.sample(range(1, n), k - 1)), n]
        S = rng.randint(k, n + 2)
        assert _split_longest(bounds, S) == rule(bounds, S), (bounds, S)


def test_a_depth_sweep_stops_where_the_caller_allows() -> None:
    """The search's seeds: depths past what `too_costly` allows are not simulated (on 5,000
    layers and 4,096 devices the full sweeps took minutes); none allowed is an error."""
    p = chain_profile([1.0, 5.0, 2.0, 2.0, 8.0, 1.0, 3.0, 3.0], params=[10**8] * 8, batch_size=8)
    c = cluster(nodes=1, per_node=8, memory_gb=80.0, intra=50.0)
    options = PlanOptions(global_batch=32, microbatch_size=4, method="uniform")
    asked: list[int] = []
    got = solve_uniform(p, c, options, too_costly=lambda S: asked.append(S) or S > 2)
    assert asked == [1, 2, 4] and got.solver["depths_tried"] == 2 and len(got.stages) <= 2
    with pytest.raises(PipeplanError, match="no pipeline depth within the work allowed"):
        solve_uniform(p, c, options, too_costly=lambda S: True)


def test_block_partition_meets_baranys_bound() -> None:
    """Bárány-Grinberg: some partition has max block <= min block + max element (normalised)."""
    rng = random.Random(4)
    for _ in range(200):
        n = rng.randint(2, 30)
        S = rng.randint(1, n)
        costs = [rng.uniform(0, 10) for _ in range(n)]
        bounds = block_partition(costs, S)
        assert len(bounds) == S + 1 and bounds[0] == 0 and bounds[-1] == n
        assert all(b > a for a, b in zip(bounds, bounds[1:], strict=False))
        lo, span = min(costs), max(costs) - min(costs)
        norm = [(c - lo) / span for c in costs]
        sums = _sums(norm, bounds)
        assert max(sums) <= min(sums) + 1 + 1e-9


@pytest.mark.parametrize("method", ["uniform", "params", "blocks"])
def test_baselines_use_deepspeed_grid_and_fit(method: str) -> None:
    p = chain_profile([1.0, 5.0, 2.0, 2.0, 8.0, 1.0, 3.0, 3.0], params=[10**8] * 8, batch_size=8)
    c = cluster(nodes=1, per_node=8, memory_gb=8.0, intra=50.0)
    plan = make_plan(p, c, PlanOptions(global_batch=32, microbatch_size=4, method=method))
    S = len(plan.stages)
    assert 8 % S == 0
    assert [s.replicas for s in plan.stages] == [8 // S] * S
    assert [d for s in plan.stages for d in s.devices] == list(range(8))
    assert [x for s in plan.stages for x in s.layers] == [f"l{i}" for i in range(8)]
    assert all(s.predicted.memory_bytes <= s.predicted.memory_limit_bytes for s in plan.stages)
    assert plan.predicted.ratio_to_lower_bound >= 1.0


def test_manual_split_is_evaluated_and_checked() -> None:
    p = chain_profile([1.0] * 8, batch_size=8)
    c = cluster(nodes=1, per_node=4)
    plan = make_plan(p, c, PlanOptions(global_batch=16, microbatch_size=4, method="manual",
                                       split=[3, 3, 2], replicas=[1, 1, 2]))
    assert [len(s.layers) for s in plan.stages] == [3, 3, 2]
    assert [s.devices for s in plan.stages] == [[0], [1], [2, 3]]
    with pytest.raises(PipeplanError, match="covers 7 layers but the profile has 8"):
        make_plan(p, c, PlanOptions(global_batch=16, method="manual", split=[3, 3, 1]))
    with pytest.raises(PipeplanError, match="needs 5 devices"):
        make_plan(p, c, PlanOptions(global_batch=16, method="manual", split=[4, 4], replicas=[4, 1]))
    # no --replicas given: the message is about the stages, not replicas the user never gave
    with pytest.raises(PipeplanError, match="gives 5 stages, one device each, but the cluster has 4"):
        make_plan(p, c, PlanOptions(global_batch=16, method="manual", split=[2, 2, 2, 1, 1]))


def test_model_that_fits_nowhere_says_what_it_needs() -> None:
    p = chain_profile([1.0] * 4, params=[4 * 10**9] * 4, batch_size=8)  # 16 GB of params
    c = cluster(nodes=1, per_node=2, memory_gb=8.0)
    for method in ("uniform", "pipedream"):
        with pytest.raises(PipeplanError, match=r"GB per device"):
            make_plan(p, c, PlanOptions(global_batch=8, method=method, optimizer="adam"))
