"""What the search scores is what `evaluate()` gives: its fast path (no events, one memory
count per stage and microbatch count, cached schedules and per-stage table scans, each
schedule shape's dependency order kept) against the full evaluation, bit for bit."""

from __future__ import annotations

import dataclasses
import random

import pytest

from planner.build import evaluate
from planner.cost import layer_table
from planner.partition import Candidate, StageChoice
from tests.planner.test_search import random_instance


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_search_evaluation_equals_the_full_one(schedule: str) -> None:
    """What the search scores (`evaluate(record=False)`: no events, one memory count per
    stage and microbatch count) is the full evaluation's time and memory, to the bit, with
    uneven replicas (m % r != 0), recomputed stages and the loss's backward working memory
    on the last stage (0 on a quarter of the instances)."""
    for seed in range(40):
        profile, cluster, options = random_instance(seed)
        options = options.model_copy(update={"schedule": schedule})
        rng = random.Random(seed)
        table = dataclasses.replace(layer_table(profile),
                                    loss_workspace_bytes=rng.choice([0, 10**5, 10**6, 3 * 10**7]))
        L, D = table.num_layers, cluster.num_devices
        S = rng.randint(1, min(L, D))
        cuts = (0, *sorted(rng.sample(range(1, L), S - 1)), L)
        devs = list(range(D))
        rng.shuffle(devs)
        stages, at = [], 0
        for k in range(S):
            r = rng.randint(1, D - at - (S - k - 1))
            stages.append(StageChoice(cuts[k], cuts[k + 1], tuple(devs[at:at + r]), recompute=rng.random() < 0.3))
            at += r
        b = options.microbatch_size or 1
        cand = Candidate(tuple(stages), b, options.global_batch // b)
        full = evaluate(table, cluster, cand, options)
        # the first time a schedule's shape comes it is simulated as it comes, then from the
        # shape kept (`simulate_generated`): both the same to the bit
        for _ in range(3):
            fast = evaluate(table, cluster, cand, options, record=False)
            assert fast.iteration_ms == full.iteration_ms
            assert fast.stage_memory_bytes == full.stage_memory_bytes
            sim, ref = fast.simulation, full.simulation
            assert (sim.busy_ms, sim.comm_ms, sim.idle_ms, sim.bubble_fraction) == \
                (ref.busy_ms, ref.comm_ms, ref.idle_ms, ref.bubble_fraction)
            assert sim.peak_memory_bytes == ref.peak_memory_bytes
            assert sim.peak_inflight == ref.peak_inflight and sim.stage_of_rank == ref.stage_of_rank
            assert sim.events == [] and ref.events


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_uneven_replicas_hold_their_own_memory(schedule: str) -> None:
    """16 microbatches on 3 and 5 replicas (the first replica runs one more than the rest;
    under GPipe it holds one more, under 1F1B as many unless its warm-up is capped): every
    rank's peak, counted once per stage and microbatch count, is its own."""
    from planner.formats import PlanOptions
    from tests.planner.helpers import chain_profile, cluster

    profile = chain_profile([1.0, 2.0, 1.5], act=[10**6, 2 * 10**6, 10**6])
    cl = cluster(nodes=1, per_node=9)
    options = PlanOptions(global_batch=32, microbatch_size=2, optimizer="sgd", schedule=schedule)
    cand = Candidate((StageChoice(0, 1, (0,)), StageChoice(1, 2, (1, 2, 3)),
                      StageChoice(2, 3, (4, 5, 6, 7, 8))), 2, 16)
    table = layer_table(profile)
    full = evaluate(table, cl, cand, options)
    for _ in range(3):  # as it comes, then from the shape kept
        fast = evaluate(table, cl, cand, options, record=False)
        assert fast.simulation.peak_memory_bytes == full.simulation.peak_memory_bytes
        assert fast.simulation.peak_inflight == full.simulation.peak_inflight
    if schedule == "gpipe":
        peaks = full.simulation.peak_inflight
        assert peaks[1] == 6 and peaks[2] == 5 and peaks[4] == 4 and peaks[5] == 3


def test_per_stage_cache_gives_the_same_costs() -> None:
    """`pipeline_costs` through one cache kept across many candidates (the search's
    `Evaluator.stage_costs`) equals the cost model without it, field for field and to the
    bit: the same stage met again as the first stage or not, recomputed or not, at another
    microbatch size, on other devices, and the cache cleared when it is full."""
    import planner.cost as cost
    from planner.cost import pipeline_costs

    for seed in range(12):
        profile, cluster, options = random_instance(seed)
        table = layer_table(profile)
        rng = random.Random(seed)
        L, D = table.num_layers, cluster.num_devices
        kept: dict = {}
        saved = cost.STAGE_COSTS_KEPT
        cost.STAGE_COSTS_KEPT = 25 if seed % 2 else saved  # cleared over and over on odd seeds
        try:
            for _ in range(60):
                S = rng.randint(1, min(L, D, 3))
                cuts = (0, *sorted(rng.sample(range(1, L), S - 1)), L)
                devs = list(range(D))
                rng.shuffle(devs)
                stages, at = [], 0
                for k in range(S):
                    r = rng.randint(1, min(2, D - at - (S - k - 1)))
                    stages.append(StageChoice(cuts[k], cuts[k + 1], tuple(sorted(devs[at:at + r])),
                                              recompute=rng.random() < 0.3))
                    at += r
                b = rng.choice([1, 2, 4])
                cand = Candidate(tuple(stages), b, 8)
                got = pipeline_costs(table, cluster, cand, options.optimizer, stage_cache=kept)
                assert got == pipeline_costs(table, cluster, cand, options.optimizer)
                assert len(kept) <= max(cost.STAGE_COSTS_KEPT, 1) + S + len(got.sends)
        finally:
            cost.STAGE_COSTS_KEPT = saved
