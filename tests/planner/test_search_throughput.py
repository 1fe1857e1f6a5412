"""`--objective throughput` (PipeDream's slowest stage, m microbatches of it per iteration):
the search's plan against every plan of a small instance, each scored by the planner's own
`evaluate()` and `throughput_objective_ms`, with the microbatch size fixed and chosen. The
search has no bound for this objective, so no proof stands behind its plan: the brute force
is the only check that it finds the optimum."""

from __future__ import annotations

import math
import random

import pytest

from planner.build import evaluate
from planner.cost import PipelineCosts, layer_table
from planner.formats import Cluster, PlanOptions, Profile
from planner.partition import Candidate, StageChoice
from planner.search import solve
from planner.search.space import throughput_objective_ms
from tests.planner.cpsat_reference import _placements, placed_stages, ranks_by_node, splits
from tests.planner.test_search import random_profile

REL = 1e-9


def steady_iteration_ms(costs: PipelineCosts) -> float:
    """PipeDream's objective, written out here: the slowest stage per microbatch (compute over
    its replicas, its all-reduce and optimizer step shared over the m microbatches, and the
    transfer into it both ways over its replicas), times m: the iteration's steady-state time,
    what plans of different microbatch sizes are compared by (one global batch)."""
    m = costs.num_microbatches
    opt = costs.optimizer_ms or (0.0,) * len(costs.stage_devices)
    slowest = 0.0
    for s, devs in enumerate(costs.stage_devices):
        r = len(devs)
        slowest = max(slowest, (costs.fwd_ms[s] + costs.bwd_ms[s]) / r + (costs.allreduce_ms[s] + opt[s]) / m)
        if s >= 1:
            slowest = max(slowest, 2 * costs.sends[(s - 1, s)].ms / r)
    return m * slowest


def brute_force_throughput_ms(profile: Profile, cluster: Cluster, options: PlanOptions) -> float:
    """The least objective over every microbatch size, split, replica vector and node placement
    that fits memory (the stages that overflow recomputed, where allowed: under 1F1B a stage's
    memory is its own, and recomputing one that fits only adds time)."""
    sizes = options.microbatch_sizes or [options.microbatch_size]
    return min(_best_of_size(profile, cluster, options.model_copy(
        update={"microbatch_size": b, "microbatch_sizes": None})) for b in sizes)


def _best_of_size(profile: Profile, cluster: Cluster, options: PlanOptions) -> float:
    table = layer_table(profile)
    b = options.microbatch_size
    assert b is not None
    m = options.global_batch // b
    specs = cluster.node_specs()
    ranks_of_node = ranks_by_node(cluster)
    best = math.inf
    for bounds in splits(table.num_layers):
        S = len(bounds) - 1
        if any(table.compute_ms(a, z) <= 0 for a, z in zip(bounds, bounds[1:], strict=False)):
            continue  # a stage that computes nothing: not a plan the search may give
        for placement in _placements([1] * S, [s.devices for s in specs]):
            stages = placed_stages(bounds, placement, ranks_of_node, [1] * S)
            cand = Candidate(tuple(stages), b, m)
            ev = evaluate(table, cluster, cand, options, record=False)
            if not ev.fits and options.allow_recompute:
                over = {s for s in range(S) if ev.stage_memory_bytes[s] > ev.costs.memory_limit_bytes[s]}
                cand = Candidate(tuple(StageChoice(x.start, x.stop, x.devices, s in over)
                                       for s, x in enumerate(stages)), b, m)
                ev = evaluate(table, cluster, cand, options, record=False)
            if ev.fits:
                best = min(best, steady_iteration_ms(ev.costs))
    return best


def _instance(seed: int) -> tuple[Profile, Cluster, PlanOptions]:
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(2, 6), dag=rng.random() < 0.5)
    nodes, per = rng.choice([(1, 2), (1, 3), (1, 4), (2, 2), (2, 1), (3, 1)])
    cluster = Cluster(nodes=nodes, devices_per_node=per, device_memory_gb=rng.choice([1, 2, 4, 40]),
                      intra_node_gb_per_s=rng.choice([0.5, 50, 300]),
                      inter_node_gb_per_s=rng.choice([0.1, 1, 25]), latency_us=rng.choice([0, 5, 3000]))
    sizes = {"microbatch_sizes": [2, 8]} if rng.random() < 0.4 else {"microbatch_size": rng.choice([2, 4, 8])}
    options = PlanOptions(global_batch=rng.choice([8, 16, 32]), optimizer=rng.choice(["sgd", "adam"]),
                          time_limit_s=2, objective="throughput", **sizes)
    return profile, cluster, options


@pytest.mark.parametrize("seeds", [range(0, 20), range(20, 40)])
def test_the_throughput_objective_finds_the_optimum_of_small_instances(seeds: range) -> None:
    checked = 0
    for seed in seeds:
        profile, cluster, options = _instance(seed)
        ref = brute_force_throughput_ms(profile, cluster, options)
        if not math.isfinite(ref):
            continue
        cand = solve(profile, cluster, options)
        table = layer_table(profile)
        concrete = options.model_copy(update={"microbatch_size": cand.microbatch_size, "microbatch_sizes": None})
        costs = evaluate(table, cluster, cand, concrete, record=False).costs
        got = steady_iteration_ms(costs)
        assert got <= ref * (1 + REL), \
            f"seed {seed}: {got} ms per iteration at microbatch size {cand.microbatch_size}, the optimum is {ref}"
        assert cand.solver["objective"] == pytest.approx(got, rel=REL) == throughput_objective_ms(costs)
        checked += 1
    assert checked >= 10, checked
