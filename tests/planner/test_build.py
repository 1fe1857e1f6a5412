import json

import pytest

from planner.build import build_plan
from planner.formats import Plan, PlanOptions
from planner.partition import Candidate, StageChoice
from planner.schedules import actions_for_rank, generate
from planner.simulator import simulate
from planner.solve import make_plan
from planner.validate import validate
from tests.planner.helpers import chain_profile, cluster


def test_plan_fields_and_json_roundtrip(tmp_path) -> None:
    p = chain_profile([1.0, 2.0, 3.0, 4.0, 2.0, 1.0], batch_size=8, skips=[(0, 4)])
    c = cluster(nodes=2, per_node=2, intra=100.0, inter=1.0, latency_us=3.0)
    cand = Candidate((StageChoice(0, 2, (0,)), StageChoice(2, 4, (1, 2)), StageChoice(4, 6, (3,))), 4, 6)
    opts = PlanOptions(global_batch=24, microbatch_size=4, method="manual", schedule="1f1b")
    plan = build_plan(p, c, cand, opts)
    assert [s.layers for s in plan.stages] == [["l0", "l1"], ["l2", "l3"], ["l4", "l5"]]
    assert plan.stages[1].replicas == 2 and plan.stages[1].devices == [1, 2]
    assert plan.predicted.throughput_samples_per_s == pytest.approx(24 / plan.predicted.iteration_ms * 1e3)
    assert plan.predicted.ratio_to_lower_bound == pytest.approx(
        plan.predicted.iteration_ms / plan.predicted.lower_bound_ms)
    assert plan.predicted.lower_bound_ms == pytest.approx(6 * 0.5 * 3 * 13.0 / 4)
    # the skip l0 -> l4 is a send from stage 0 straight to stage 2
    assert {snd["to"] for snd in plan.stages[0].predicted.sends} == {1, 2}
    assert plan.rank_actions is not None and plan.rank_actions["3"][:2] == ["2F0", "2B0"]
    validate({int(r): a for r, a in plan.rank_actions.items()}, 3, 6, deps=[(0, 1), (1, 2), (0, 2)])
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    again = Plan.model_validate(json.loads(path.read_text()))
    assert simulate(again).iteration_ms == pytest.approx(plan.predicted.iteration_ms)
    assert simulate(again).bubble_fraction == pytest.approx(plan.predicted.bubble_fraction)


def test_large_plans_store_the_generator() -> None:
    p = chain_profile([1.0] * 256, batch_size=1)
    c = cluster(nodes=16, per_node=8, memory_gb=80.0)
    plan = make_plan(p, c, PlanOptions(global_batch=128, microbatch_size=1, method="manual",
                                       split=[2] * 128))
    assert plan.rank_actions is None and plan.generator is not None
    full = generate("1f1b", [s.devices for s in plan.stages], 128)
    for r in (0, 77, 127):
        assert actions_for_rank(plan, r) == full[r]
    again = Plan.model_validate_json(plan.model_dump_json())
    assert simulate(again).iteration_ms == pytest.approx(plan.predicted.iteration_ms)


def test_gpipe_plan_memory_counts_all_microbatches() -> None:
    p = chain_profile([1.0] * 4, act=[10**6] * 4, params=[0] * 4, batch_size=8)
    c = cluster(nodes=1, per_node=2)
    one = make_plan(p, c, PlanOptions(global_batch=64, microbatch_size=8, method="manual",
                                      split=[2, 2], schedule="1f1b"))
    gp = make_plan(p, c, PlanOptions(global_batch=64, microbatch_size=8, method="manual",
                                     split=[2, 2], schedule="gpipe"))
    assert one.stages[0].predicted.memory_bytes == 2 * 2 * 10**6
    assert gp.stages[0].predicted.memory_bytes == 8 * 2 * 10**6


def test_a_stage_that_fits_never_shows_more_memory_than_its_limit() -> None:
    """Memory rounded up and the limit down: 1000000001 bytes on a limit of 1000000000 beside
    `fits_memory: true`."""
    from planner.formats import Cluster, PlanOptions, Profile
    from planner.solve import make_plan

    profile = Profile.model_validate({
        "model": {"path": "x", "sha256": "0"}, "device": {"type": "cpu", "name": "x"}, "batch_size": 8,
        "layers": [{"name": "l0", "fwd_ms": 1.0, "bwd_ms": 2.0, "param_bytes": 0,
                    "activation_bytes": 8000000004, "output_bytes": 0}]})
    cluster = Cluster(nodes=1, devices_per_node=1, device_memory_gb=1.0000000006,
                      intra_node_gb_per_s=10, inter_node_gb_per_s=1)
    plan = make_plan(profile, cluster, PlanOptions(global_batch=1, microbatch_size=1, optimizer="sgd"))
    st = plan.stages[0].predicted
    assert plan.predicted.fits_memory and st.memory_bytes <= st.memory_limit_bytes, st


def test_the_microbatch_limit_counts_the_sizes_the_plan_would_use() -> None:
    """Given sizes decide how many microbatches there are, not the profile's batch (a global batch
    of 2**20 with sizes 65536 / 131072 was refused as 131072 microbatches of the profile's 8); with
    no size, the default size (the largest divisor up to the profile's batch) does: a prime global
    batch is as many microbatches of 1 (it passed as 100003 // 8 and failed later)."""
    from planner.errors import PipeplanError

    p = chain_profile([1.0, 2.0, 3.0], batch_size=8)
    c = cluster(nodes=1, per_node=2, memory_gb=1e6)
    plan = make_plan(p, c, PlanOptions(global_batch=2**20, microbatch_sizes=[65536, 131072],
                                       method="cpsat", time_limit_s=2))
    assert plan.num_microbatches in (8, 16)
    with pytest.raises(PipeplanError, match="100003 makes more than 100000 microbatches"):
        make_plan(p, c, PlanOptions(global_batch=100003, method="uniform"))


def test_the_default_microbatch_is_the_largest_divisor_up_to_the_batch_size() -> None:
    """Against the divisors themselves; a profile batch of 10^12 is answered at once (a loop over
    the sizes never ended), and a global batch whose divisor makes more than the planner plans
    is refused with what to do."""
    import random

    from planner.build import largest_divisor_size
    from planner.errors import PipeplanError

    rng = random.Random(0)
    for _ in range(3000):
        b, g = rng.randint(1, 300), rng.randint(1, 5000)
        assert largest_divisor_size(b, g) == max(d for d in range(1, min(b, g) + 1) if g % d == 0)
    assert largest_divisor_size(10**12, 10**12) == 10**12
    assert largest_divisor_size(10**12, 2 * 10**12) == 10**12
    with pytest.raises(PipeplanError, match="more than 100000 microbatches.*--microbatch-size"):
        largest_divisor_size(24, 1_000_003)  # a prime: microbatches of 1
