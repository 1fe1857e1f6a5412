"""`planner.search.bound.tighten`: the bound once more after the search, with the cross-stage
conditions (a stage's last backward after its successor's; a DAG's tensors sent past the next
stage). It must stay a bound (never above the exhaustive optimum under `evaluate()`), never
fall below the bound it starts from, and raise it on some instances."""

from __future__ import annotations

import random

import pytest

from planner.cost import layer_table
from planner.formats import PlanOptions
from planner.search.bound import conditions, hop_bytes, lower_bound, tighten
from tests.planner.cpsat_reference import brute_force
from tests.planner.test_search import random_cluster, random_profile

REL = 1e-9


@pytest.mark.slow
def test_tightened_bound_holds_against_brute_force() -> None:
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
    assert raised >= 2, raised
