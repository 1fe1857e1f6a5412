"""The memory-filling seeds of the search (`planner.search._packed_seeds`): the balanced packing
against a brute force over every split, and every seed fits memory as `evaluate()` counts it."""

from __future__ import annotations

import itertools
import math
import random

import pytest

import planner.search as search
from planner.build import evaluate
from planner.cost import layer_table, microbatch_scale, stage_memory_bytes
from planner.formats import Cluster, PlanOptions, Profile
from planner.partition import Candidate, StageChoice
from planner.search import _balanced_pack, _packed_seeds, solve
from tests.planner.helpers import chain_profile
from tests.planner.test_search import gnmt_like


def _chain(rng: random.Random, n: int) -> Profile:
    return chain_profile([rng.uniform(0.1, 3.0) for _ in range(n)], [rng.uniform(0.2, 6.0) for _ in range(n)],
                         params=[rng.randrange(10**6, 10**8) for _ in range(n)],
                         act=[rng.randrange(10**6, 10**8) for _ in range(n)], out=[10**5] * n, batch_size=4)


def _memory(table, bounds: tuple[int, ...], scale: float, m: int, S: int) -> list[float]:
    return [stage_memory_bytes(table.param_bytes(bounds[s], bounds[s + 1]),
                               table.activation_bytes(bounds[s], bounds[s + 1]), scale,
                               min(m, S - s), "sgd") for s in range(len(bounds) - 1)]


def _brute(table, b: int, m: int, limit: float, S: int) -> tuple[float, tuple[int, ...]] | None:
    """Least largest stage compute (and its split) over every split into at most S stages where
    stage s holds min(m, S - s) microbatches in flight (the conditions `_balanced_pack` packs
    under)."""
    L, scale = table.num_layers, microbatch_scale(table.batch_size, b)
    best = None
    for n in range(1, min(S, L) + 1):
        for cuts in itertools.combinations(range(1, L), n - 1):
            bounds = (0, *cuts, L)
            if max(_memory(table, bounds, scale, m, S)) <= limit:
                worst = max(scale * table.compute_ms(bounds[s], bounds[s + 1]) for s in range(n))
                if best is None or worst < best[0]:
                    best = (worst, bounds)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_pack_is_the_least_largest_stage_that_fits(seed: int) -> None:
    rng = random.Random(seed)
    table = layer_table(_chain(rng, rng.randint(2, 8)))
    b, m, S = rng.choice([2, 4, 8]), rng.randint(2, 8), rng.randint(2, 6)
    scale = microbatch_scale(table.batch_size, b)
    # memory that binds: below what the fastest split without a limit needs
    free = _brute(table, b, m, float("inf"), S)
    assert free is not None
    limit = max(_memory(table, free[1], scale, m, S)) * rng.uniform(0.7, 1.0)
    want = _brute(table, b, m, limit, S)
    got = _balanced_pack(table, b, m, "sgd", limit, S)
    if want is None:
        assert got is None
        return
    assert got is not None and len(got) - 1 <= S and max(_memory(table, got, scale, m, S)) <= limit
    worst = max(scale * table.compute_ms(a, z) for a, z in zip(got, got[1:], strict=False))
    assert worst == pytest.approx(want[0], rel=2e-4)


@pytest.mark.parametrize("seed", range(6))
def test_every_packed_seed_fits_memory_as_evaluate_counts_it(seed: int) -> None:
    rng = random.Random(100 + seed)
    profile = _chain(rng, rng.randint(12, 30))
    table = layer_table(profile)
    total = stage_memory_bytes(table.param_bytes(0, table.num_layers),
                               table.activation_bytes(0, table.num_layers), 1.0, 16, "sgd")
    cluster = Cluster(nodes=2, devices_per_node=4, device_memory_gb=total * rng.uniform(0.2, 0.5) / 1e9,
                      intra_node_gb_per_s=10, inter_node_gb_per_s=1)
    options = PlanOptions(global_batch=64, microbatch_size=4, optimizer="sgd")
    seeds = _packed_seeds(table, cluster, options, 4)
    assert seeds and len({s.bounds for s in seeds}) == len(seeds) and all(set(s.replicas) == {1} for s in seeds)
    # the same splits, the free devices as replicas (every device used)
    spread = search._spread_seeds(table, seeds, 16, cluster.num_devices)
    assert {s.bounds for s in spread} == {s.bounds for s in seeds if len(s.replicas) < cluster.num_devices}
    assert all(sum(s.replicas) == cluster.num_devices for s in spread)
    for st in seeds:
        stages = tuple(StageChoice(a, z, (k,)) for k, (a, z) in enumerate(zip(st.bounds, st.bounds[1:], strict=False)))
        ev = evaluate(table, cluster, Candidate(stages, 4, 16), options)
        assert ev.fits, st.bounds


def test_spread_replicas_go_where_the_busiest_replica_gains_most() -> None:
    """Against a brute force over one free device at a time: each goes to the stage whose
    ceil(m / r) x compute drops most (ties: the earliest)."""
    rng = random.Random(7)
    for _ in range(30):
        table = layer_table(_chain(rng, rng.randint(4, 12)))
        L = table.num_layers
        S = rng.randint(1, min(L, 5))
        bounds = (0, *sorted(rng.sample(range(1, L), S - 1)), L)
        m, D = rng.choice([8, 16]), S + rng.randint(0, 6)
        comp = [table.compute_ms(a, z) for a, z in zip(bounds, bounds[1:], strict=False)]
        want = [1] * S
        for _ in range(D - S):
            gains = [(math.ceil(m / want[k]) - math.ceil(m / (want[k] + 1))) * comp[k] for k in range(S)]
            want[gains.index(max(gains))] += 1
        assert search._spread_replicas(table, bounds, m, D) == tuple(want)


def test_the_packed_search_never_makes_the_plan_worse(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = gnmt_like()
    cluster = Cluster(nodes=16, devices_per_node=1, device_memory_gb=16, intra_node_gb_per_s=1,
                      inter_node_gb_per_s=1)
    options = PlanOptions(global_batch=1024, microbatch_size=64, optimizer="sgd", time_limit_s=1)
    monkeypatch.setattr(search, "HOPELESS_GAP", 0.05)  # the plan's gap here is about 10 %
    now = solve(profile, cluster, options)
    assert now.solver["gap"] > search.HOPELESS_GAP  # the branch where the packed search runs
    again = solve(profile, cluster, options)
    assert [(x.start, x.stop, x.replicas) for x in again.stages] == [(x.start, x.stop, x.replicas) for x in now.stages]
    monkeypatch.setattr(search, "PACK_SHARE", 0.0)
    monkeypatch.setattr(search, "SPREAD_SHARE", 0.0)
    monkeypatch.setattr(search, "_packed_seeds", lambda *a, **k: [])
    before = solve(profile, cluster, options)
    assert now.solver["objective"] <= before.solver["objective"]
    assert now.solver["bound"] == before.solver["bound"]
