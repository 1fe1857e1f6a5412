"""The search once more from the tightened DP's plans (`planner.search._tightened_seeds`, on
its own share of the work after `bound.tighten`) and, where the DP is too large to bisect
before the search, from its plans on a coarser grid of cuts (`_coarse_seeds`): where memory
binds, the first seeds lead the local search far from the best plan. Judged against plans
found outside the planner (the DPs bisected on their own, their plans simulated) and against
the search without that share."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from planner.build import evaluate
from planner.cost import layer_table
from planner.formats import Cluster, PlanOptions, Profile
from planner.importers.pipedream import import_pipedream_file
from planner.partition import Candidate, StageChoice
from planner.search import solve_detailed
from tests.planner.test_search import random_profile

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "pipedream-profiles"


def consecutive(bounds: tuple[int, ...], replicas: tuple[int, ...], recompute: tuple[bool, ...]
                ) -> tuple[StageChoice, ...]:
    """Stages between `bounds` on consecutive devices, each with its replicas and recomputation."""
    stages, d = [], 0
    for (a, z), r, rc in zip(zip(bounds[:-1], bounds[1:], strict=True), replicas, recompute, strict=True):
        stages.append(StageChoice(a, z, tuple(range(d, d + r)), recompute=rc))
        d += r
    return tuple(stages)


@pytest.mark.skipif(not (DATA / "resnet18.txt").is_file(), reason="no PipeDream profiles in ../shared/data")
def test_resnet18_tight_memory_as_fast_as_the_tightened_dps_plan() -> None:
    """ResNet-18 (batch 128), 4 nodes x 4 devices at 10 / 1 GB/s, the plan-quality suite's
    tight memory (3.70 GB: the least that fits plus 20 %), 16 microbatches. Bisecting the
    cross-stage DP on its own, its plan at 3091 ms (first stage alone and recomputed, three
    replicas of layers 1-3, then one device each) simulates to 2958.8 ms; the search stopped at
    3970.4 ms before it also started from the tightened DP's plans. Checked here by
    evaluate() on that plan, placed on consecutive devices, not by the planner's own figure."""
    profile = import_pipedream_file(DATA / "resnet18.txt", 128)
    cluster = Cluster(nodes=4, devices_per_node=4, intra_node_gb_per_s=10, inter_node_gb_per_s=1,
                      device_memory_gb=3.7025428528661504)
    options = PlanOptions(global_batch=16 * 128, microbatch_size=128, optimizer="sgd",
                          time_limit_s=10, schedule="1f1b")
    stages = consecutive((0, 1, 4, 8, 17, 70), (1, 3, 1, 1, 1), (True, False, False, False, False))
    ref = evaluate(layer_table(profile), cluster, Candidate(stages, 128, 16), options)
    assert ref.fits and math.isclose(ref.iteration_ms, 2958.8, rel_tol=1e-3), ref.iteration_ms
    cand, info = solve_detailed(profile, cluster, options)
    assert info["objective"] <= ref.iteration_ms * (1 + 1e-9), (info["objective"], ref.iteration_ms)
    assert info["bound"] <= info["objective"]


def tight_chain_or_dag(seed: int) -> tuple[Profile, Cluster, PlanOptions]:
    """20-40 random layers (chain or DAG) on 4-16 devices at 0.5-10 GB/s with 2-4 GB each:
    slow links and memory that binds, where the seeding bisection's plans mislead."""
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(20, 40), dag=rng.random() < 0.5)
    cluster = Cluster(nodes=rng.choice([4, 8]), devices_per_node=rng.choice([1, 2]),
                      intra_node_gb_per_s=rng.choice([1, 10]), inter_node_gb_per_s=rng.choice([0.5, 1]),
                      device_memory_gb=rng.choice([2, 3, 4]))
    options = PlanOptions(global_batch=64, microbatch_size=8, optimizer="sgd", time_limit_s=2,
                          schedule="1f1b")
    return profile, cluster, options


# seed: (plan without the tightened DP's plans, ms; with them, when measured: 2026-12-05, since
# the search's evaluations are charged their time; seed 2 now reaches 661.13 either way)
MEASURED = {0: (692.83, 635.37), 2: (661.13, 661.13), 4: (474.57, 474.57), 31: (507.23, 473.83),
            39: (951.42, 916.13)}


@pytest.mark.parametrize("seed", sorted(MEASURED))
def test_the_tightened_dps_plans_never_make_the_plan_worse(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """They run after the search on extra work: the plan is the search's own or better, and the
    bound holds for it. On 3 of these 5 instances the plan is better for them (seed 0: 692.8
    -> 635.4 ms); when they came, on 9 of the first 40 seeds, and worse on none. (Measured with the 1 % proof
    always tried: where it is out of reach its work searches on from the best plan, which
    reaches the same plans on seeds 0 and 2 without these seeds. The last descent from the best
    plan, `_polish`, is off in both runs: since 2026-12-02 it reaches the same plans on seeds 2
    and 31 without them.)"""
    import planner.search as search

    monkeypatch.setattr(search, "HOPELESS_GAP", math.inf)
    monkeypatch.setattr(search, "POLISH_SHARE", 0.0)
    profile, cluster, options = tight_chain_or_dag(seed)
    with_them = solve_detailed(profile, cluster, options)[1]
    saved = search.TIGHTENED_SHARE
    try:
        search.TIGHTENED_SHARE = 0.0
        without = solve_detailed(profile, cluster, options)[1]
    finally:
        search.TIGHTENED_SHARE = saved
    assert with_them["objective"] <= without["objective"] * (1 + 1e-9)
    assert with_them["bound"] <= with_them["objective"] * (1 + 1e-9)
    before, after = MEASURED[seed]
    if after < before * (1 - 1e-3):  # where they helped when measured, they still help
        assert with_them["objective"] < without["objective"] * (1 - 1e-3), (with_them["objective"], without["objective"])


@pytest.mark.skipif(not (DATA / "resnet50.txt").is_file(), reason="no PipeDream profiles in ../shared/data")
def test_resnet50_on_128_devices_tight_memory_as_fast_as_a_coarse_grids_plan() -> None:
    """ResNet-50 (batch 128), 16 nodes x 8 devices at 300 / 25 GB/s, the suite's tight memory
    (2.35 GB), 16 microbatches: too large for the DP before the search, whose seeds were the
    baselines alone; it stopped at 2212.9 ms. A plan of the DP restricted to every 4th layer,
    with the search's own choice of recomputation (stage 9) and placement, simulates to
    1243.0 ms under evaluate()."""
    profile = import_pipedream_file(DATA / "resnet50.txt", 128)
    cluster = Cluster(nodes=16, devices_per_node=8, intra_node_gb_per_s=300, inter_node_gb_per_s=25,
                      device_memory_gb=2.3456213513387745)
    options = PlanOptions(global_batch=16 * 128, microbatch_size=128, optimizer="sgd",
                          time_limit_s=10, schedule="1f1b")
    stages = consecutive((0, 8, 12, 20, 28, 36, 52, 72, 80, 84, 88, 100, 116, 136, 176),
                         (16, 8, 16, 16, 16, 16, 16, 8, 2, 1, 3, 2, 2, 2), tuple(s == 9 for s in range(14)))
    ref = evaluate(layer_table(profile), cluster, Candidate(stages, 128, 16), options)
    assert ref.fits and math.isclose(ref.iteration_ms, 1243.0, rel_tol=1e-3), ref.iteration_ms
    _, info = solve_detailed(profile, cluster, options)
    assert info["objective"] <= ref.iteration_ms * (1 + 1e-9), (info["objective"], ref.iteration_ms)
    assert info["bound"] <= info["objective"]
