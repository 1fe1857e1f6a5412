"""`planner.search.bound.tighten`: the bound once more after the search, with the cross-stage
conditions (a stage's last backward after its successor's; a DAG's tensors sent past the next
stage). It must stay a bound (never above the exhaustive optimum under `evaluate()`), never
fall below the bound it starts from, and raise it on some instances."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.cost import layer_table
from planner.formats import Cluster, PlanOptions
from planner.importers.pipedream import import_pipedream_file
from planner.search.bound import (
    Conditions,
    _narrow,
    _per_microbatch,
    conditions,
    feasible,
    hop_bytes,
    lower_bound,
    proof_conditions,
    restrict,
    tighten,
    tighten_step_work,
    variant_choices,
)
from tests.planner.cpsat_reference import brute_force
from tests.planner.test_search import random_cluster, random_profile

REL = 1e-9
GNMT = Path(__file__).resolve().parents[3] / "shared" / "data" / "pipedream-profiles" / "gnmt.txt"


@pytest.mark.slow
def test_tightened_bound_holds_against_brute_force() -> None:
    """Unlimited, and on work for one or two steps."""
    raised = 0
    for seed in range(30):
        rng = random.Random(seed)
        profile = random_profile(rng, rng.randint(3, 6), dag=rng.random() < 0.6)
        cluster = random_cluster(rng, mixed=False, max_nodes=3)
        options = PlanOptions(global_batch=rng.choice([8, 16]), microbatch_size=2,
                              optimizer=rng.choice(["sgd", "adam"]),
                              schedule=rng.choice(["1f1b", "gpipe", "zb-h1"]))
        ref = brute_force(profile, cluster, options, [2])
        if ref.candidate is None:
            continue
        table = layer_table(profile)
        c = conditions(table, cluster, options.optimizer, options.schedule, options.global_batch, 2,
                       hop_bytes(table))
        first, _ = lower_bound(c, upper_ms=ref.iteration_ms * 1.5)
        assert first is not None
        got, spent = tighten(c, first.bound_ms, ref.iteration_ms * 1.5, max_work=float("inf"))
        assert got >= first.bound_ms
        assert got <= ref.iteration_ms * (1 + REL), f"seed {seed}: {got} above the optimum {ref.iteration_ms}"
        assert spent > 0 or got >= ref.iteration_ms * 1.5 * (1 - 1e-4) or first.bound_ms >= ref.iteration_ms * 1.5
        raised += got > first.bound_ms * 1.01
        step = tighten_step_work(c)
        for steps in (1, 2):  # a scarce budget: probes first where a step may prove 1 %
            budget = steps * step + step // 2
            got, spent = tighten(c, 0.0, ref.iteration_ms, max_work=budget, upper_feasible=True)
            assert spent <= budget
            assert got <= ref.iteration_ms * (1 + REL), f"seed {seed}: {got} above the optimum"
    assert raised >= 2, raised


def test_a_restricted_dp_is_feasible_only_where_the_full_one_is() -> None:
    """`restrict` keeps only some cut positions: every plan it admits is one the full DP
    admits, so it is never feasible where the full DP is not, and with every cut it is the
    full DP (chains and DAGs, recomputed variants, the cross-stage conditions)."""
    checked = 0
    for seed in range(16):
        rng = random.Random(seed)
        profile = random_profile(rng, rng.randint(4, 9), dag=rng.random() < 0.5)
        cluster = random_cluster(rng, mixed=False, max_nodes=2)
        table = layer_table(profile)
        c = conditions(table, cluster, "sgd", rng.choice(["1f1b", "gpipe", "zb-h1"]), 16, 2,
                       hop_bytes(table), recompute=rng.random() < 0.5)
        c = replace(c, cross_stage=rng.random() < 0.5)  # DAG skips and last backwards too
        L = c.L
        first, _ = lower_bound(c, upper_ms=1e9)
        if first is None:  # nothing fits memory
            continue
        checked += 1
        inner = sorted(rng.sample(range(1, L), rng.randint(0, L - 1)))
        cuts = np.array([0, *inner, L])
        full = restrict(c, np.arange(L + 1))
        for T in (first.bound_ms * f for f in (0.9, 1.0001, 1.2, 1.5, 3.0)):
            assert feasible(full, T) == feasible(c, T)
            if feasible(restrict(c, cuts), T):
                assert feasible(c, T), f"seed {seed}: restricted feasible at {T}, full not"
    assert checked >= 8, checked


def _assert_a_plan_of(c, T: float, plan, seed: int) -> None:
    """`plan` (`plan_at`'s tuple) is a plan of `c`'s layers and devices, and on exactly its own
    cuts the DP meets the round trips at T (not the cross-stage conditions: the DP minimises
    their end times on their own beside the round trip, so the round trip's path need not meet
    them)."""
    bounds, reps, tps, _ = plan
    assert bounds[0] == 0 and bounds[-1] == c.L and all(np.diff(bounds) > 0), bounds
    assert sum(r * t for r, t in zip(reps, tps, strict=True)) <= c.D
    weak = replace(c, cross_stage=False, grouped=False)
    assert feasible(restrict(weak, np.array(bounds)), T * (1 + 1e-9)), (seed, T, bounds)


def test_a_scarce_budget_narrows_on_restricted_dps_and_stays_below_the_dp_bound(monkeypatch) -> None:
    """On 60-80 layers and 16 devices, with work for two to four steps: the restricted DPs run (their work
    is the remainder no full step could use) and the result never exceeds the bound the same
    DP reaches with unlimited work (every raise of it is a time at which the full DP has no
    plan). The plans it hands to the search (`feasible_at`: the restricted DP's, mapped back to
    layers, and each feasible step's) are plans, and meet the DP's round trips at their times."""
    import planner.search.bound as bound_mod

    narrowed = planned = 0
    real = bound_mod._narrow

    def counting(*args, **kwargs):
        nonlocal narrowed
        out = real(*args, **kwargs)
        narrowed += out[1] > 0
        return out

    monkeypatch.setattr(bound_mod, "_narrow", counting)
    for seed in range(8):
        rng = random.Random(100 + seed)
        profile = random_profile(rng, rng.randint(60, 80), dag=rng.random() < 0.5)
        per_node = rng.choice([1, 8])
        cluster = Cluster(nodes=16 // per_node, devices_per_node=per_node, device_memory_gb=80,
                          intra_node_gb_per_s=rng.choice([1, 300]), inter_node_gb_per_s=rng.choice([0.5, 10]))
        table = layer_table(profile)
        c = conditions(table, cluster, "sgd", rng.choice(["1f1b", "gpipe"]), 16, 2, hop_bytes(table))
        first, _ = lower_bound(c, upper_ms=1e9)
        if first is None:
            continue
        upper = first.bound_ms * rng.choice([1.005, 1.05, 1.3])
        full, _ = tighten(c, 0.0, upper, max_work=float("inf"), upper_feasible=True)
        step = tighten_step_work(c)
        for steps in (2, 3, 4):
            budget = steps * step + int(0.99 * step)
            found: list = []
            got, spent = tighten(c, 0.0, upper, max_work=budget, upper_feasible=True, feasible_at=found)
            assert spent <= budget
            assert got <= full * (1 + 1e-3), f"seed {seed}: {got} above the DP's own bound {full}"
            for T, plan in found:  # the plans the search starts from once more
                planned += 1
                _assert_a_plan_of(c, T, plan, seed)
    assert narrowed >= 3, narrowed
    assert planned >= 8, planned


def test_the_narrowing_plan_is_a_plan_in_the_layers() -> None:
    """`_narrow`'s plan on a coarser grid goes to the search as a seed (`feasible_at`): its
    boundaries are layers of the whole model (not indices into the grid), from 0 to L, and on
    exactly those cuts the DP meets the round trips at its time."""
    recorded = 0
    for seed in range(6):
        rng = random.Random(200 + seed)
        profile = random_profile(rng, rng.randint(60, 80), dag=rng.random() < 0.5)
        cluster = Cluster(nodes=4, devices_per_node=4, device_memory_gb=80,
                          intra_node_gb_per_s=rng.choice([1, 300]), inter_node_gb_per_s=rng.choice([0.5, 10]))
        table = layer_table(profile)
        c = conditions(table, cluster, "sgd", "1f1b", 16, 2, hop_bytes(table))
        first, _ = lower_bound(c, upper_ms=1e9)
        assert first is not None
        cz = replace(c, cross_stage=True, prefix_hops=False)
        found: list = []
        _narrow(cz, first.bound_ms, first.bound_ms * 1.3, 40 * tighten_step_work(cz), math.inf, found)
        for T, plan in found:
            recorded += 1
            _assert_a_plan_of(c, T, plan, seed)
    assert recorded >= 4, recorded


@pytest.mark.slow
def test_per_microbatch_conditions_hold_against_brute_force_and_raise_the_bound() -> None:
    """Each microbatch's last backward (`Conditions.per_microbatch`): where a replicated stage
    runs few microbatches, the one that sets the time may not be the last. The bound with it
    never exceeds the exhaustive optimum under `evaluate()` (chains and DAGs, every schedule,
    tight memory with recomputation, up to 7 devices on 3 nodes) and is above the bound
    without it on some instances."""
    checked = raised = 0
    for seed in range(5000, 5060):
        setting = _small_setting(seed)
        if setting is None:
            continue
        c, optimum, first = setting
        checked += 1
        without = _cross_stage_bound(c, optimum, first)
        cz = replace(c, cross_stage=True)
        with_q, _ = _per_microbatch(cz, without, optimum, float("inf"), 1e-6, float("inf"))
        assert with_q <= optimum * (1 + REL), f"seed {seed}: {with_q} above the optimum {optimum}"
        raised += with_q > without * 1.01
    assert checked >= 30, checked
    # 5020 by 1.0 %; before the first and last microbatch's cross-stage conditions also 5023
    # and 5034, which those now raise as far or further
    assert raised >= 1, raised


def _small_setting(seed: int) -> tuple[Conditions, float, float] | None:
    """A random instance of up to 7 devices on 3 nodes (every schedule, recomputation), its
    conditions, exhaustive optimum under `evaluate()` and first (cross-stage) bound."""
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(2, 6), dag=rng.random() < 0.5)
    cluster = random_cluster(rng, mixed=rng.random() < 0.3, max_nodes=3)
    if cluster.num_devices > 7:
        return None
    gb = rng.choice([8, 16, 24, 32])
    options = PlanOptions(global_batch=gb, microbatch_size=2, optimizer=rng.choice(["sgd", "adam"]),
                          schedule=rng.choice(["1f1b", "gpipe", "zb-h1"]))
    ref = brute_force(profile, cluster, options, [2])
    if ref.candidate is None:
        return None
    table = layer_table(profile)
    c = conditions(table, cluster, options.optimizer, options.schedule, gb, 2, hop_bytes(table), recompute=True)
    first, _ = lower_bound(replace(c, cross_stage=True), upper_ms=ref.iteration_ms * 1.5)
    assert first is not None
    return c, ref.iteration_ms, first.bound_ms


def _cross_stage_bound(c: Conditions, optimum: float, first: float) -> float:
    got, _ = tighten(c, first, optimum, max_work=float("inf"), upper_feasible=True, per_microbatch=False)
    return got


@pytest.mark.slow
def test_the_first_and_last_microbatch_raise_the_cross_stage_bound() -> None:
    """The cross-stage bound with the first microbatch's warm-up round trip and the last
    microbatch's way down the pipeline (the module docstring of `bound`), on instances where
    both matter: never above the exhaustive optimum, and at it or far above where the bound
    was before them (measured then)."""
    before = {5025: 21.4147, 5026: 46.5883, 5029: 10.2468, 5033: 27.7548, 5034: 9.082, 5045: 28.5479}
    for seed, was in before.items():
        setting = _small_setting(seed)
        assert setting is not None
        c, optimum, first = setting
        got = _cross_stage_bound(c, optimum, first)
        assert got <= optimum * (1 + REL), f"seed {seed}: {got} above the optimum {optimum}"
        assert got >= min(optimum * (1 - 1e-3), was * 1.15), f"seed {seed}: {got}, was {was}, optimum {optimum}"


def test_per_microbatch_conditions_skip_arrays_too_large(monkeypatch) -> None:
    """A long --time-limit on a large instance could afford the per-microbatch DP, whose arrays
    grow with layers x devices x microbatches: above PER_MICROBATCH_CELLS it is not run (no
    work spent, the bound as it was), below it runs."""
    import planner.search.bound as bound_mod

    rng = random.Random(7)
    profile = random_profile(rng, 6, dag=False)
    cluster = Cluster(nodes=1, devices_per_node=4, device_memory_gb=80, intra_node_gb_per_s=1,
                      inter_node_gb_per_s=1)
    table = layer_table(profile)
    c = replace(conditions(table, cluster, "sgd", "1f1b", 16, 2, hop_bytes(table)), cross_stage=True)
    cells = bound_mod.per_microbatch_cells(replace(c, per_microbatch=True))
    monkeypatch.setattr(bound_mod, "PER_MICROBATCH_CELLS", cells - 1)
    assert _per_microbatch(c, 1.0, 100.0, float("inf"), 1e-4, float("inf")) == (1.0, 0)
    monkeypatch.setattr(bound_mod, "PER_MICROBATCH_CELLS", cells)
    assert _per_microbatch(c, 1.0, 100.0, float("inf"), 1e-4, float("inf"))[1] > 0



def test_the_prefix_hops_price_every_replica_count_by_its_own_warm_up() -> None:
    """5 replicas at m = 16 run ceil(16 / 5) = 4 microbatches on the busiest, as 4 do, but hold
    fewer in flight: ceil(10 / 5) = 2 with 5 devices after them, where 4 replicas hold 3. The
    prefix DP priced the 5 as the 4 (its replica choice), so a stage that fits memory only as
    5 replicas was no prefix at all, and `exhaust` missed every plan through it: SqueezeNet on
    16 x 1 devices, tight, reported "optimal" at 4016.0 ms against a plan of 3901.8 that fits.
    Here (found by random plans, the instance of seed 28), every stage of the plan of 6, 5 and
    5 replicas must be one the DP allows at the plan's own time."""
    from helpers import chain_profile

    from planner.build import evaluate
    from planner.partition import Candidate, StageChoice
    from planner.search import proof_conditions
    from planner.search.bound import allowed_stages

    rng = random.Random(28)
    L = rng.randint(3, 5)
    profile = chain_profile([rng.uniform(0.5, 2) for _ in range(L)],
                            params=[rng.randrange(10**6, 10**8) for _ in range(L)],
                            act=[rng.randrange(10**8, 2 * 10**9) for _ in range(L)],
                            out=[rng.randrange(10**6, 10**8) for _ in range(L)], batch_size=2)
    cluster = Cluster(nodes=16, devices_per_node=1, device_memory_gb=rng.uniform(1, 8),
                      intra_node_gb_per_s=1, inter_node_gb_per_s=1)
    table = layer_table(profile)
    bounds, reps = (0, 1, 2, 3), (6, 5, 5)
    assert table.num_layers == 3
    stages, rank = [], 0
    for a, z, r in zip(bounds, bounds[1:], reps, strict=False):
        stages.append(StageChoice(a, z, tuple(range(rank, rank + r))))
        rank += r
    ev = evaluate(table, cluster, Candidate(tuple(stages), 2, 16),
                  PlanOptions(global_batch=32, microbatch_size=2, optimizer="sgd"))
    assert ev.fits
    cz = proof_conditions(conditions(table, cluster, "sgd", "1f1b", 32, 2, hop_bytes(table), (1,), False))
    edges = allowed_stages(cz, ev.iteration_ms * (1 + REL), cap=10**9)
    d = sum(reps)
    for a, z, r in zip(bounds, bounds[1:], reps, strict=False):
        assert (z, r, 1) in edges.by_state.get((a, d), ()), (a, z, r, d)
        d -= r


@pytest.mark.slow
def test_replica_counts_past_a_node_keep_the_bound_below_brute_force() -> None:
    """`variant_choices`: a replica choice whose counts reach past a node is split there
    (with the cross-stage conditions). On random clusters of 2-3 nodes of 2 devices where
    such a choice exists, the tightened bound stays at or below the exhaustive optimum."""
    checked = 0
    for seed in range(200):
        rng = random.Random(seed)
        profile = random_profile(rng, rng.randint(2, 5), dag=rng.random() < 0.3)
        cluster = Cluster(nodes=rng.randint(2, 3), devices_per_node=2, device_memory_gb=rng.choice([1, 40]),
                          intra_node_gb_per_s=300, inter_node_gb_per_s=rng.choice([0.01, 0.1, 1.0]))
        options = PlanOptions(global_batch=8, microbatch_size=2, optimizer="sgd",
                              schedule=rng.choice(["1f1b", "gpipe"]))
        table = layer_table(profile)
        c = conditions(table, cluster, options.optimizer, options.schedule, options.global_batch, 2,
                       hop_bytes(table))
        if all(len(variant_choices(replace(c, cross_stage=True), v)[0]) == len(variant_choices(c, v)[0])
               for v in c.variants):
            continue  # no choice reaches past a node
        ref = brute_force(profile, cluster, options, [2])
        if ref.candidate is None:
            continue
        first, _ = lower_bound(c, upper_ms=ref.iteration_ms * 1.5)
        assert first is not None
        got, _ = tighten(c, first.bound_ms, ref.iteration_ms, max_work=float("inf"), upper_feasible=True)
        assert got <= ref.iteration_ms * (1 + REL), f"seed {seed}: {got} above the optimum {ref.iteration_ms}"
        checked += 1
        if checked >= 16:
            break
    assert checked >= 10, checked


@pytest.mark.skipif(not GNMT.exists(), reason="needs ../shared/data/pipedream-profiles")
def test_a_stage_of_more_replicas_than_a_node_all_reduces_across_nodes() -> None:
    """GNMT on 4 x 4 devices (10 / 1 GB/s): the cross-stage DP priced a stage of 5 replicas as
    one of 4, all-reduced inside a node (44 ms where across nodes it is 440), and met every
    condition at 193.3 ms; split at the node, its least feasible time is 214.2 ms (the planner's
    plan: 234.05 ms)."""
    profile = import_pipedream_file(GNMT, 64)
    cluster = Cluster(nodes=4, devices_per_node=4, device_memory_gb=80, intra_node_gb_per_s=10,
                      inter_node_gb_per_s=1)
    table = layer_table(profile)
    c = conditions(table, cluster, "sgd", "1f1b", 16 * 64, 64, hop_bytes(table))
    cz = replace(proof_conditions(c), microbatch_paths=True)
    assert not feasible(cz, 213.0)
    assert feasible(cz, 234.05)
