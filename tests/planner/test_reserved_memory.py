"""Memory the framework keeps on every device for itself (cuBLAS workspaces: measured on an H100
as 2 x 32 MiB, one per thread that runs matmuls) is not the model's: a plan must fit in what is
left, and its predicted peak must include it, since `torch.cuda.max_memory_allocated` does."""

from __future__ import annotations

import pytest
from helpers import chain_profile, cluster

from planner.errors import PipeplanError
from planner.formats import GB, PlanOptions, Profile
from planner.refine import Corrections, StageCorrection, corrected_plan
from planner.schedules import plan_actions
from planner.simulator import costs_from_plan, simulate_costs
from planner.solve import make_plan

WORKSPACE = 64 * 2**20


def _profile(workspace: int) -> Profile:
    # 4 layers of 1 GB of parameters: with SGD a device holding all of them needs 8 GB + activations
    p = chain_profile([1.0] * 4, params=[10**9] * 4, act=[1000] * 4)
    return p.model_copy(update={"device": p.device.model_copy(
        update={"type": "cuda", "name": "NVIDIA H100", "workspace_bytes": workspace})})


def _one_stage(**kw: object) -> PlanOptions:
    return PlanOptions(global_batch=8, microbatch_size=8, method="manual", split=[4],
                       optimizer="sgd", **kw)


def test_the_prediction_includes_the_reserve_and_the_limit_is_the_real_device():
    c = cluster(1, 1, memory_gb=9.0)
    bare = make_plan(_profile(0), c, _one_stage()).stages[0].predicted
    got = make_plan(_profile(WORKSPACE), c, _one_stage())
    p = got.stages[0].predicted
    assert p.memory_bytes == bare.memory_bytes + WORKSPACE
    assert p.memory_limit_bytes == bare.memory_limit_bytes == 9 * GB
    assert got.cluster == c  # the plan describes the devices as they are


def test_a_plan_that_fits_only_without_the_reserve_is_refused_with_the_reason():
    need = make_plan(_profile(0), cluster(1, 1, memory_gb=9.0), _one_stage()).stages[0].predicted.memory_bytes
    tight = cluster(1, 1, memory_gb=(need + WORKSPACE / 2) / GB)
    make_plan(_profile(0), tight, _one_stage())  # fits the device's nominal memory
    with pytest.raises(PipeplanError, match="cuBLAS workspaces.*reserved_memory_gb"):
        make_plan(_profile(WORKSPACE), tight, _one_stage())
    # the cluster's own figure wins over the profile's
    lenient = tight.model_copy(update={"reserved_memory_gb": 0.0})
    assert make_plan(_profile(WORKSPACE), lenient, _one_stage()).stages[0].predicted.memory_bytes == need
    strict = cluster(1, 1, memory_gb=9.0).model_copy(update={"reserved_memory_gb": (9 * GB - need + 1) / GB})
    with pytest.raises(PipeplanError, match="does not fit"):
        make_plan(_profile(0), strict, _one_stage())


def test_the_solver_plans_around_the_reserve():
    need = make_plan(_profile(0), cluster(1, 1, memory_gb=9.0), _one_stage()).stages[0].predicted.memory_bytes
    c = cluster(1, 2, memory_gb=(need + WORKSPACE / 2) / GB)
    opts = PlanOptions(global_batch=8, microbatch_size=8, optimizer="sgd", time_limit_s=5)
    plan = make_plan(_profile(WORKSPACE), c, opts)
    # one device cannot hold every layer and the reserve: the plan spreads them and fits
    assert len(plan.stages) == 2
    assert sum(len(st.layers) for st in plan.stages) == 4
    for st in plan.stages:
        assert st.predicted.memory_bytes <= st.predicted.memory_limit_bytes == int(c.device_memory_gb * GB)  # type: ignore[operator]


def test_a_plan_file_replays_with_the_reserve_held_from_the_start():
    plan = make_plan(_profile(WORKSPACE), cluster(1, 2, memory_gb=9.0),
                     PlanOptions(global_batch=16, microbatch_size=8, method="manual", split=[2, 2],
                                 optimizer="sgd"))
    sim = simulate_costs(costs_from_plan(plan), plan_actions(plan))
    for st in plan.stages:
        assert max(sim.peak_memory_bytes[d] for d in st.devices) == pytest.approx(st.predicted.memory_bytes, abs=1)
    # refine's corrected plan keeps it too (no correction: the same memory)
    stages = [StageCorrection(index=s.index, layers=s.layers, predicted_fwd_ms=s.predicted.fwd_ms,
                              measured_fwd_ms=s.predicted.fwd_ms, fwd_scale=1.0,
                              predicted_bwd_ms=s.predicted.bwd_ms, measured_bwd_ms=s.predicted.bwd_ms,
                              bwd_scale=1.0, predicted_activation_bytes=1.0,
                              measured_activation_bytes=1.0, memory_scale=1.0) for s in plan.stages]
    corr = Corrections.model_construct(stages=stages, p2p_overhead_us_after=0.0)
    again = corrected_plan(plan, corr, plan.cluster)
    for a, b in zip(plan.stages, again.stages, strict=True):
        assert b.predicted.memory_bytes == pytest.approx(a.predicted.memory_bytes, abs=1)


def test_a_cpu_profile_reserves_nothing():
    p = chain_profile([1.0] * 4, params=[10**9] * 4, act=[1000] * 4)
    assert p.device.workspace_bytes == 0
    plan = make_plan(p, cluster(1, 1, memory_gb=9.0), _one_stage())
    assert getattr(plan.stages[0].predicted, "reserved_memory_bytes", None) is None


@pytest.mark.parametrize("device_gb", [0.4234567895, 0.4234568, 0.43])
def test_a_fractional_reserve_never_shows_a_fitting_stage_above_its_limit(device_gb):
    """An outside review: reserved_memory_gb of 0.1234567895 (123456789.5 bytes) on a stage that
    needs exactly what is left: the plan said it fits with memory_bytes 1 above its
    memory_limit_bytes (the memory got the reserve rounded up, the limit rounded down), and the
    simulator's peak was half a byte off the plan's. Whole bytes of reserve now, both sides."""
    from planner.simulator import simulate

    p = chain_profile([1.0], params=[10**8], act=[10**8]).model_copy(update={"batch_size": 4})
    c = cluster(1, 1, memory_gb=device_gb).model_copy(update={"reserved_memory_gb": 0.1234567895})
    opts = PlanOptions(global_batch=4, microbatch_size=4, optimizer="sgd", time_limit_s=2)
    try:
        plan = make_plan(p, c, opts)
    except PipeplanError as exc:
        assert device_gb < 0.4234568 and "no plan can fit" in str(exc)  # the 1-byte edge
        return
    st = plan.stages[0].predicted
    assert plan.predicted.fits_memory
    assert st.memory_bytes <= st.memory_limit_bytes <= device_gb * GB + 1  # (+1: float noise, ceil)
    assert simulate(plan).peak_memory_bytes[0] == st.memory_bytes
