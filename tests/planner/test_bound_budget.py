"""The bound's bisection inside the deterministic work budget: cut short it stays a bound
(looser, never above the full bisection's), a known floor saves steps without moving it, and
the search reports the work its DP spent within the share it was given."""

from __future__ import annotations

import math
import random

from helpers import chain_profile, cluster

from planner.cost import layer_table
from planner.formats import PlanOptions
from planner.search import DP_SHARE, WORK_PER_SECOND, solve_detailed
from planner.search.bound import conditions, dp_work, feasible, lower_bound


def _conditions(seed: int):
    rng = random.Random(seed)
    n = rng.randint(6, 14)
    prof = chain_profile([rng.uniform(0.1, 2.0) for _ in range(n)],
                         out=[rng.randint(10**5, 10**7) for _ in range(n)])
    cl = cluster(nodes=rng.choice([1, 2, 4]), per_node=rng.choice([1, 2, 4]), intra=10.0, inter=1.0,
                 latency_us=5.0)
    return conditions(layer_table(prof), cl, "sgd", rng.choice(["1f1b", "gpipe", "zb-h1"]), 32, 8 // 2)


def test_a_bisection_cut_short_is_still_a_bound_and_spends_what_it_says():
    for seed in range(12):
        c = _conditions(seed)
        full, spent_full = lower_bound(c, upper_ms=math.inf)
        step = dp_work(c)
        cut, spent_cut = lower_bound(c, upper_ms=math.inf, max_work=4 * step)
        assert full is not None and cut is not None
        assert cut.bound_ms <= full.bound_ms * (1 + 1e-12)  # looser, never above
        # within its work and one step over at most (the plan's DP after the last test); the
        # flat DP's steps and the grouped DP's (`dp_work(c)`, the larger) both counted
        assert spent_cut <= 5 * step
        assert spent_full >= step
        # the bound is a time where the conditions fail (or the floor where they already hold)
        assert not feasible(c, cut.bound_ms * (1 - 1e-9)) or cut.bound_ms == full.bound_ms


def test_a_known_floor_saves_steps_and_keeps_the_bound():
    for seed in range(12):
        c = _conditions(seed)
        full, spent_full = lower_bound(c, upper_ms=math.inf)
        assert full is not None
        floored, spent = lower_bound(c, upper_ms=math.inf, lower_ms=0.9 * full.bound_ms)
        assert floored is not None
        assert abs(floored.bound_ms - full.bound_ms) <= 2e-4 * full.bound_ms
        assert spent <= spent_full


def test_the_search_reports_its_dp_work_within_its_share():
    rng = random.Random(3)
    prof = chain_profile([rng.uniform(0.1, 2.0) for _ in range(12)],
                         out=[rng.randint(10**5, 10**7) for _ in range(12)])
    cl = cluster(nodes=4, per_node=2, intra=10.0, inter=1.0, latency_us=5.0)
    opts = PlanOptions(global_batch=32, microbatch_sizes=[2, 4, 8], time_limit_s=3.0)
    _, info = solve_detailed(prof, cl, opts)
    total = WORK_PER_SECOND * opts.time_limit_s
    assert 0 < info["bound_work"] <= info["work"]
    # each size's bisection stays within its share but for its last step and plan
    assert info["bound_work"] <= DP_SHARE * total + 3 * max(
        dp_work(conditions(layer_table(prof), cl, "sgd", "1f1b", 32, b)) for b in (2, 4, 8))
    again = solve_detailed(prof, cl, opts)[1]
    assert (again["objective"], again["bound"], again["work"]) == \
        (info["objective"], info["bound"], info["work"])


def test_the_layer_only_dp_cut_short_is_still_a_bound_within_its_work():
    """`large.dp_lower_bound` counts `layer_dp_work` per DP: given a few DPs' work it stops
    there with a bound no higher than the full bisection's, and below two DPs it does not run."""
    from planner.search.large import dp_lower_bound, layer_dp_work, replica_choices

    for seed in range(6):
        rng = random.Random(seed)
        n = rng.randint(20, 60)
        prof = chain_profile([rng.uniform(0.1, 2.0) for _ in range(n)],
                             params=[rng.randint(10**6, 10**8) for _ in range(n)],
                             out=[rng.randint(10**5, 10**7) for _ in range(n)])
        cl = cluster(nodes=4, per_node=4, intra=10.0, inter=1.0, latency_us=5.0)
        options = PlanOptions(global_batch=32, microbatch_size=2, optimizer="sgd")
        table = layer_table(prof)
        recompute = seed % 2 == 1
        step = layer_dp_work(n, len(replica_choices(16, 16)), recompute)
        full, spent_full = dp_lower_bound(table, cl, options, 2, math.inf, rel_tol=1e-6,
                                          recompute=recompute)
        cut, spent_cut = dp_lower_bound(table, cl, options, 2, math.inf, rel_tol=1e-6,
                                        recompute=recompute, max_work=4 * step)
        assert full is not None and cut is not None
        assert spent_full > 4 * step >= spent_cut >= 2 * step
        assert cut.bound_ms <= full.bound_ms * (1 + 1e-12)
        assert dp_lower_bound(table, cl, options, 2, math.inf, recompute=recompute,
                              max_work=2 * step - 1) == (None, 0)


def test_the_layer_only_dp_with_no_plan_known_ends_when_nothing_fits():
    """No upper time and no work limit, and a layer larger than every device: one DP at an
    unlimited time says that nothing fits (a bound of inf), instead of doubling the time for
    ever (or, before, 30 times); with an upper time, after the DP there fails too."""
    from planner.search.large import dp_lower_bound, layer_dp_work, replica_choices

    prof = chain_profile([1.0, 1.0], params=[10**6, 10**11])
    options = PlanOptions(global_batch=32, microbatch_size=2, optimizer="sgd")
    step = layer_dp_work(2, len(replica_choices(16, 4)), False)
    found, spent = dp_lower_bound(layer_table(prof), cluster(nodes=2, per_node=2), options, 2, math.inf)
    assert found is not None and found.bound_ms == math.inf and not found.seed and spent == step
    found, spent = dp_lower_bound(layer_table(prof), cluster(nodes=2, per_node=2), options, 2, 100.0)
    assert found is not None and found.bound_ms == math.inf and spent == 2 * step
