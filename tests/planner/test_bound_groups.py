"""The bound's node groups (`planner.search.bound._suffix_dp`): a hop is on a fast link only
if both stages share a node, so runs of fast hops keep their stages on one node. Pricing hops
that way must stay a bound (never above the exhaustive optimum under `evaluate()`), never be
looser than the DP that prices a hop fast whenever one more device fits the node, and be
tighter where links between nodes are slow."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from planner.cost import layer_table
from planner.formats import Cluster, PlanOptions
from planner.search.bound import conditions, hop_bytes, lower_bound
from tests.planner.cpsat_reference import brute_force
from tests.planner.test_search import random_profile

REL = 1e-9


def _instance(seed: int):
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(4, 6), dag=rng.random() < 0.5)
    nodes, per = rng.choice([(3, 2), (2, 3), (2, 2)])
    cluster = Cluster(nodes=nodes, devices_per_node=per, device_memory_gb=rng.choice([2, 8, 40]),
                      intra_node_gb_per_s=rng.choice([50, 300]),
                      inter_node_gb_per_s=rng.choice([0.1, 0.5, 2]), latency_us=rng.choice([0, 5, 500]),
                      # a calibrated cluster's per-class latencies, below `latency_us` here
                      **({"intra_node_latency_us": 1.0, "inter_node_latency_us": 20.0}
                         if rng.random() < 0.3 else {}))
    options = PlanOptions(global_batch=rng.choice([8, 16]), microbatch_size=2,
                          optimizer=rng.choice(["sgd", "adam"]), schedule=rng.choice(["1f1b", "gpipe"]))
    return profile, cluster, options


def _bounds(profile, cluster, options):
    table = layer_table(profile)
    c = conditions(table, cluster, options.optimizer, options.schedule, options.global_batch,
                   options.microbatch_size, hop_bytes(table))
    grouped, _ = lower_bound(c, upper_ms=float("inf"), rel_tol=1e-6)
    flat, _ = lower_bound(replace(c, grouped=False), upper_ms=float("inf"), rel_tol=1e-6)
    return grouped, flat


@pytest.mark.slow
def test_grouped_bound_holds_against_brute_force_and_is_tighter_on_slow_links() -> None:
    tighter = 0
    for seed in range(24):
        profile, cluster, options = _instance(seed)
        grouped, flat = _bounds(profile, cluster, options)
        ref = brute_force(profile, cluster, options, [options.microbatch_size])
        if ref.candidate is None:
            continue
        assert grouped is not None and flat is not None
        assert grouped.bound_ms <= ref.iteration_ms * (1 + REL), f"seed {seed}: above the optimum"
        assert grouped.bound_ms >= flat.bound_ms * (1 - 1e-5), f"seed {seed}: looser than flat"
        tighter += grouped.bound_ms > flat.bound_ms * 1.01
    assert tighter >= 3, tighter


def test_a_chain_over_four_nodes_crosses_them_and_the_bound_sees_it() -> None:
    """16 equal layers of 100 MB of parameters sending 10 MB each, 4 nodes x 4 devices, 100 GB/s
    inside a node and 1 GB/s between: a plan using more than one node crosses a slow link,
    which the flat DP did not know (it priced a hop fast whenever one more device fit the
    node): 95.0 ms against 64.6."""
    from helpers import chain_profile

    prof = chain_profile([1.0] * 16, out=[10**7] * 16, params=[10**8] * 16)
    cl = Cluster(nodes=4, devices_per_node=4, device_memory_gb=80, intra_node_gb_per_s=100,
                 inter_node_gb_per_s=1)
    grouped, flat = _bounds(prof, cl, PlanOptions(global_batch=64, microbatch_size=prof.batch_size))
    assert grouped is not None and flat is not None
    assert grouped.bound_ms > 1.4 * flat.bound_ms


@pytest.mark.parametrize("cross_stage", [False, True])
def test_without_groups_and_hop_classes_the_dp_is_a_relaxation(cross_stage: bool) -> None:
    """`search._idle_checked` tests the DP without node groups and hop classes first (where
    that saves work) and takes its "no plan at T" as a proof: that holds only if it has a plan
    wherever the full DP has one (DAGs with skips over several nodes, 0-ms stages allowed or
    not, each condition set)."""
    from planner.search import _relaxations_first
    from planner.search.bound import feasible, without_classes

    classed = differed = 0
    for seed in range(32):
        profile, cluster, options = _instance(100 + seed)
        table = layer_table(profile)
        rng = random.Random(seed)
        c = conditions(table, cluster, options.optimizer, options.schedule, options.global_batch,
                       options.microbatch_size, hop_bytes(table), recompute=rng.random() < 0.5)
        c = replace(c, idle_stages=rng.random() < 0.5, cross_stage=cross_stage,
                    microbatch_paths=cross_stage and rng.random() < 0.5)
        tests = _relaxations_first(c)
        assert tests[-1][1] is c and all(4 * a[0] <= b[0] for a, b in zip(tests, tests[1:], strict=False))
        if not (c.grouped or c.hop_classes > 1):
            continue
        cheap = replace(without_classes(c), grouped=False)
        assert len(tests) == 1 or (tests[0][1].hop_classes == 1 and not tests[0][1].grouped)
        classed += c.hop_classes > 1
        first, _ = lower_bound(c, upper_ms=float("inf"), rel_tol=1e-6)
        if first is None:
            continue
        for f in (0.5, 0.8, 0.95, 1.0, 1.0001, 1.05, 1.3, 2.0):
            T = first.bound_ms * f
            full_ok, cheap_ok = feasible(c, T), feasible(cheap, T)
            assert cheap_ok or not full_ok, f"seed {seed}: the relaxation has no plan at {T}"
            differed += cheap_ok and not full_ok
    assert classed >= 3 and differed >= 2, (classed, differed)
