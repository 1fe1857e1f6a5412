"""Frozen parameters (`requires_grad=False`: a frozen embedding or backbone) have no gradient,
no optimizer state and no all-reduce: the cost model counts them once, and the search and its
bound with it (a bound that kept charging them would be above plans that fit)."""

from __future__ import annotations

import random

import pytest

from planner.build import evaluate
from planner.cost import OPTIMIZER_EXTRA_COPIES, layer_table, pipeline_costs
from planner.errors import PipeplanError
from planner.formats import Cluster, LayerProfile, PlanOptions, Profile
from planner.partition import Candidate, StageChoice
from planner.search import needs_recompute_variant, solve
from planner.search.bound import conditions, feasible, proof_conditions
from tests.planner.cpsat_reference import brute_force
from tests.planner.test_search import random_instance

REL = 1e-9


def _frozen(profile: Profile, rng: random.Random) -> Profile:
    """The same profile with some layers' parameters frozen, wholly or in part."""
    layers = []
    for x in profile.layers:
        share = rng.choice([0.0, 0.0, 0.5, 1.0])
        layers.append(x.model_copy(update={"frozen_param_bytes": int(share * x.param_bytes)}))
    return profile.model_copy(update={"layers": layers})


def test_frozen_parameters_are_counted_once_and_not_all_reduced() -> None:
    from tests.planner.helpers import chain_profile, cluster

    p = chain_profile([1.0, 1.0], params=[4_000_000, 1_000_000])
    p = p.model_copy(update={"layers": [p.layers[0].model_copy(update={"frozen_param_bytes": 3_000_000}),
                                        p.layers[1]]})
    cl = cluster(nodes=1, per_node=4)
    cand = Candidate((StageChoice(0, 1, (0, 1)), StageChoice(1, 2, (2,))), 2, 4)
    for opt in ("sgd", "momentum", "adam"):
        k = OPTIMIZER_EXTRA_COPIES[opt]
        costs = pipeline_costs(layer_table(p), cl, cand, opt)
        # stage 0: 4 MB of parameters, 1 MB of them trained: params + (1 + k) x trained
        assert costs.static_memory_bytes[0] == 4_000_000 + (1 + k) * 1_000_000
        assert costs.static_memory_bytes[1] == (2 + k) * 1_000_000
    plain = p.model_copy(update={"layers": [p.layers[0].model_copy(update={"frozen_param_bytes": 0,
                                                                          "param_bytes": 1_000_000}),
                                            p.layers[1]]})
    # the all-reduce moves the trained megabyte only: as a stage of 1 MB without frozen ones
    assert pipeline_costs(layer_table(p), cl, cand, "sgd").allreduce_ms[0] == \
        pipeline_costs(layer_table(plain), cl, cand, "sgd").allreduce_ms[0]
    with pytest.raises(ValueError, match="frozen_param_bytes"):
        LayerProfile.model_validate({**p.layers[1].model_dump(), "frozen_param_bytes": 2_000_000})


def test_buffers_are_counted_once_and_not_all_reduced_nor_in_the_plans_parameters() -> None:
    """A layer's buffers (`buffer_bytes`: BatchNorm statistics, masks) are held once per device
    like frozen parameters, and the plan's `param_bytes` (checked against the model the runtime
    builds) leaves them out."""
    from planner.build import build_plan
    from tests.planner.helpers import chain_profile, cluster

    p = chain_profile([1.0, 1.0], params=[1_000_000, 1_000_000])
    p = p.model_copy(update={"layers": [p.layers[0].model_copy(update={"buffer_bytes": 5_000_000}),
                                        p.layers[1]]})
    plain = chain_profile([1.0, 1.0], params=[1_000_000, 1_000_000])
    cl = cluster(nodes=1, per_node=4)
    cand = Candidate((StageChoice(0, 1, (0, 1)), StageChoice(1, 2, (2,))), 2, 4)
    for opt in ("sgd", "adam"):
        k = OPTIMIZER_EXTRA_COPIES[opt]
        costs, bare = pipeline_costs(layer_table(p), cl, cand, opt), pipeline_costs(layer_table(plain), cl, cand, opt)
        assert costs.static_memory_bytes[0] == (2 + k) * 1_000_000 + 5_000_000
        assert costs.static_memory_bytes[1] == bare.static_memory_bytes[1]
        assert costs.allreduce_ms == bare.allreduce_ms
    options = PlanOptions(global_batch=8, microbatch_size=2, optimizer="sgd")
    plan = build_plan(p, cl, cand, options)
    assert [st.param_bytes for st in plan.stages] == [1_000_000, 1_000_000]


def _least_memory_gb(profile: Profile, cluster: Cluster, options: PlanOptions) -> float | None:
    """The least device memory at which the exhaustive search finds a plan (bisected)."""
    def fits(gb: float) -> bool:
        cl = cluster.model_copy(update={"device_memory_gb": gb})
        return brute_force(profile, cl, options, [options.microbatch_size]).candidate is not None

    lo, hi = 1e-6, 1e3
    if not fits(hi):
        return None
    for _ in range(24):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


@pytest.mark.parametrize("block", range(2))
def test_frozen_parameters_equal_brute_force(block: int) -> None:
    """Random chains and DAGs with frozen layers, on the least memory where the exhaustive
    search finds a plan (where counting frozen parameters as trained finds none) and on 30 %
    more: the plan is the exhaustive optimum under `evaluate()` and the bound is never above
    it."""
    checked = 0
    for seed in range(block * 12, block * 12 + 12):
        profile, cluster, options = random_instance(seed, mixed=False)
        profile = _frozen(profile, random.Random(1000 + seed))
        least = _least_memory_gb(profile, cluster, options)
        if least is None:
            continue
        for gb in (least, 1.3 * least):
            cl = cluster.model_copy(update={"device_memory_gb": gb})
            ref = brute_force(profile, cl, options, [options.microbatch_size])
            assert ref.candidate is not None
            cand = solve(profile, cl, options)  # a plan fits: the planner must find one
            ev = evaluate(layer_table(profile), cl, cand, options)
            assert ev.fits
            assert float(cand.solver["bound"]) <= ref.iteration_ms * (1 + REL), f"seed {seed}: bound above the optimum"
            assert ev.iteration_ms == pytest.approx(ref.iteration_ms, rel=REL), f"seed {seed} at {gb} GB"
            # the bound's conditions, with and without the cross-stage ones, admit the
            # optimum at its own time (else the bound could rise above it)
            table = layer_table(profile)
            c = conditions(table, cl, options.optimizer, options.schedule, options.global_batch,
                           options.microbatch_size,
                           recompute=needs_recompute_variant(table, cl, options, options.microbatch_size))
            T = ref.iteration_ms * (1 + 1e-9)
            assert feasible(c, T) and feasible(proof_conditions(c), T), f"seed {seed} at {gb} GB"
            checked += 1
    assert checked >= 12


def test_a_frozen_embedding_fits_where_a_trained_one_would_not() -> None:
    """A large frozen embedding on devices too small for it with its gradient and Adam state:
    a plan, where the same model with the embedding trained has none."""
    from tests.planner.helpers import chain_profile

    p = chain_profile([0.1, 1.0, 1.0], params=[5_000_000, 20_000, 20_000])
    frozen = p.model_copy(update={"layers": [p.layers[0].model_copy(update={"frozen_param_bytes": 5_000_000}),
                                             *p.layers[1:]]})
    cl = Cluster(nodes=1, devices_per_node=2, device_memory_gb=0.012, intra_node_gb_per_s=10,
                 inter_node_gb_per_s=1)
    options = PlanOptions(global_batch=8, microbatch_size=2, optimizer="adam", time_limit_s=2)
    cand = solve(frozen, cl, options)
    assert evaluate(layer_table(frozen), cl, cand, options).fits
    with pytest.raises(PipeplanError, match="alone needs"):
        solve(p, cl, options)
