"""The optimizer step: once per iteration on every device of a stage, after its last backward
and its all-reduce (planner.cost, planner.simulator). Checked against closed forms of 1F1B and
GPipe, the profile's per-layer figures through the cost model, the search (the planner's plan
equals the exhaustive optimum under `evaluate()` with the step priced), and the refine loop."""

from __future__ import annotations

import dataclasses

import pytest

from planner.cost import layer_table, pipeline_costs
from planner.formats import PlanOptions, Report
from planner.partition import Candidate, StageChoice
from planner.refine import corrected_plan, corrected_profile, fit
from planner.schedules import generate
from planner.simulator import simulate_costs, simulate_generated
from planner.solve import make_plan
from tests.planner.cpsat_reference import brute_force
from tests.planner.helpers import chain_profile, cluster, equal_costs


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S,m", [(1, 4), (2, 4), (4, 8)])
def test_the_step_follows_each_stage_closed_form(schedule: str, S: int, m: int) -> None:
    """Equal stages F = 1, B = 2, free messages: stage s's last backward ends 2 * s ms before
    stage 0's, at (m + S - 1) * 3 - 2 * s, so the iteration is the largest of that plus the
    stage's own step."""
    base = equal_costs(S, m)
    plain = simulate_costs(base, generate(schedule, base.stage_devices, m)).iteration_ms
    assert plain == pytest.approx((m + S - 1) * 3.0)
    for opt in [(0.5,) * S, tuple(float(10 * s) for s in range(S)), (0.0,) * (S - 1) + (7.0,)]:
        costs = dataclasses.replace(base, optimizer_ms=opt)
        sim = simulate_costs(costs, generate(schedule, base.stage_devices, m))
        want = max(plain - 2.0 * s + opt[s] for s in range(S))
        assert sim.iteration_ms == pytest.approx(want)
        ev = [e for e in sim.events if e.kind == "optimizer"]
        assert sorted((e.stage, round(e.end_ms - e.start_ms, 9)) for e in ev) == \
            sorted((s, opt[s]) for s in range(S) if opt[s] > 0)
        assert sim.busy_ms[0] == pytest.approx(m * 3.0 + opt[0])


def test_the_step_follows_the_all_reduce() -> None:
    base = dataclasses.replace(equal_costs(2, 4, replicas=2), allreduce_ms=(1.5, 0.25))
    acts = generate("1f1b", base.stage_devices, 4)
    plain = simulate_costs(base, acts)
    with_opt = simulate_costs(dataclasses.replace(base, optimizer_ms=(2.0, 0.0)), acts)
    ar0 = max(e.end_ms for e in plain.events if e.kind == "allreduce" and e.stage == 0)
    assert with_opt.iteration_ms == pytest.approx(max(plain.iteration_ms, ar0 + 2.0))
    for e in (e for e in with_opt.events if e.kind == "optimizer"):
        assert e.start_ms == pytest.approx(ar0)


def test_fast_evaluation_prices_the_step_to_the_bit() -> None:
    """The search's evaluation (`simulate_generated`) and the full simulation agree exactly."""
    prof = chain_profile([1.0, 2.0, 0.5, 1.5], params=[10**6, 3 * 10**6, 0, 10**6])
    for x, ms in zip(prof.layers, [0.3, 0.9, 0.0, 0.3], strict=True):
        x.optimizer_ms = {"adam": ms, "sgd": ms / 3}
    table = layer_table(prof)
    cl = cluster(nodes=1, per_node=4)
    cand = Candidate((StageChoice(0, 2, (0, 1)), StageChoice(2, 4, (2,))), 2, 8)
    costs = pipeline_costs(table, cl, cand, "adam")
    assert costs.optimizer_ms == pytest.approx((1.2, 0.3))
    assert pipeline_costs(table, cl, cand, "momentum").optimizer_ms is None  # not measured
    full = simulate_costs(costs, generate("1f1b", costs.stage_devices, 8))
    fast = simulate_generated(costs, "1f1b")
    assert fast.iteration_ms == full.iteration_ms
    assert fast.busy_ms == full.busy_ms


def test_a_slower_device_steps_slower() -> None:
    prof = chain_profile([1.0, 1.0])
    for x in prof.layers:
        x.optimizer_ms = {"sgd": 0.4}
    cl = cluster(nodes=1, per_node=2).model_copy(update={"speed": 0.5})
    cand = Candidate((StageChoice(0, 1, (0,)), StageChoice(1, 2, (1,))), 8, 1)
    assert pipeline_costs(layer_table(prof), cl, cand, "sgd").optimizer_ms == pytest.approx((0.8, 0.8))


@pytest.mark.parametrize("seed", range(6))
def test_planner_equals_brute_force_when_the_step_decides(seed: int) -> None:
    """A large step on one layer's parameters: where they sit and how many replicas share the
    pipeline decide the plan; the planner's plan is the exhaustive optimum under `evaluate()`."""
    import random

    rng = random.Random(seed)
    L = rng.randint(3, 6)
    prof = chain_profile([rng.uniform(0.5, 3) for _ in range(L)],
                         params=[rng.randint(10**5, 10**8) for _ in range(L)],
                         out=[rng.randint(10**4, 10**7) for _ in range(L)])
    for x in prof.layers:
        x.optimizer_ms = {"adam": x.param_bytes / rng.choice([1e6, 1e7, 1e8])}
    cl = cluster(nodes=1, per_node=rng.randint(2, 4), memory_gb=80, intra=rng.choice([1.0, 100.0]))
    opts = PlanOptions(global_batch=16, microbatch_size=2, optimizer="adam", time_limit_s=5,
                       schedule=rng.choice(["1f1b", "gpipe"]))
    ref = brute_force(prof, cl, opts, [2])
    plan = make_plan(prof, cl, opts)
    assert ref is not None
    assert plan.predicted.iteration_ms == pytest.approx(ref.iteration_ms, rel=1e-9)
    assert plan.solver.bound is None or plan.solver.bound <= plan.predicted.iteration_ms * (1 + 1e-9)
    assert plan.solver.bound is None or plan.solver.bound <= ref.iteration_ms * (1 + 1e-9)


def _report(plan, fwd, bwd, opt_ms, iteration_ms: float = 1.0) -> Report:
    return Report.model_validate({
        "plan_profile_sha256": plan.profile_sha256, "steps": 5, "iteration_ms": iteration_ms,
        "samples_per_s": 1.0, "predicted_iteration_ms": plan.predicted.iteration_ms, "losses": [],
        "ranks": [{"rank": d, "stage": st.index, "replica": k // st.tp, "fwd_ms_per_microbatch": fwd,
                   "bwd_ms_per_microbatch": bwd, "comm_ms": 0.0, "idle_ms": 0.0,
                   "peak_memory_bytes": int(st.predicted.memory_bytes), "peak_inflight_microbatches": 1,
                   **({"optimizer_ms": opt_ms[st.index]} if opt_ms is not None else {})}
                  for st in plan.stages for k, d in enumerate(st.devices)]})


def test_refine_takes_the_measured_step() -> None:
    prof = chain_profile([1.0, 1.0, 1.0, 1.0], params=[10**6] * 4)
    for x in prof.layers:
        x.optimizer_ms = {"adam": 0.25, "sgd": 0.1}
    opts = PlanOptions(global_batch=16, microbatch_size=2, optimizer="adam", split=[2, 2], method="manual")
    plan = make_plan(prof, cluster(nodes=1, per_node=2, memory_gb=80), opts)
    assert [st.predicted.optimizer_ms for st in plan.stages] == pytest.approx([0.5, 0.5])
    f, b = plan.stages[0].predicted.fwd_ms, plan.stages[0].predicted.bwd_ms
    # the run took 2.5 ms more per iteration, all of it in stage 0's step: refine puts it there,
    # not into the per-message overhead or the compute
    c = fit(plan, _report(plan, f, b, [3.0, 0.5], plan.predicted.iteration_ms + 2.5))
    assert c.p2p_overhead_us_after < 1e-3 and c.compute_scale == 1.0
    assert [s.measured_optimizer_ms for s in c.stages] == [3.0, 0.5]
    new = corrected_profile(prof, c, "adam")
    assert [x.optimizer_ms["adam"] for x in new.layers] == pytest.approx([1.5, 1.5, 0.25, 0.25])
    assert [x.optimizer_ms["sgd"] for x in new.layers] == pytest.approx([0.1] * 4)  # not run
    again = corrected_plan(plan, c, plan.cluster)
    assert [st.predicted.optimizer_ms for st in again.stages] == pytest.approx([3.0, 0.5])
    assert again.predicted.iteration_ms == pytest.approx(plan.predicted.iteration_ms + 2.5, rel=1e-6)
    # a report without the figure (an older runtime) keeps the prediction
    old = fit(plan, _report(plan, f, b, None, plan.predicted.iteration_ms))
    assert corrected_plan(plan, old, plan.cluster).predicted.iteration_ms == pytest.approx(
        plan.predicted.iteration_ms, rel=1e-6)


def test_refine_shares_a_measured_step_out_by_parameters_where_the_profile_had_none() -> None:
    prof = chain_profile([1.0, 1.0], params=[3 * 10**6, 10**6])
    opts = PlanOptions(global_batch=16, microbatch_size=2, optimizer="adam", split=[2], method="manual")
    plan = make_plan(prof, cluster(nodes=1, per_node=1, memory_gb=80), opts)
    st = plan.stages[0].predicted
    # the run took its 2 ms step on top of what the plan predicted (the profile had no step)
    c = fit(plan, _report(plan, st.fwd_ms, st.bwd_ms, [2.0], plan.predicted.iteration_ms + 2.0))
    new = corrected_profile(prof, c, "adam")
    assert [x.optimizer_ms for x in new.layers] == [{"adam": 1.5}, {"adam": 0.5}]


def _refit(prof, cl, opts, measured_times):
    """Plan, 'run' it with the given per-stage steps (the rest as predicted), refine, re-plan."""
    plan = make_plan(prof, cl, opts)
    p0 = plan.stages[0].predicted
    c = fit(plan, _report(plan, p0.fwd_ms, p0.bwd_ms, measured_times(plan), plan.predicted.iteration_ms))
    new = corrected_profile(prof, c, opts.optimizer)
    return plan, new, make_plan(new, cl, opts)


def test_refine_keeps_a_step_measured_as_predicted_on_slower_devices_and_tp_stages() -> None:
    """The profile's steps are at speed 1 and for whole layers; a run on half-speed devices, or
    on a TP stage whose ranks step their shards, measures the prediction itself: nothing moves."""
    from tests.planner.test_tensor_parallel_cost import _cluster, _profile

    prof = chain_profile([1.0] * 4, params=[10**6] * 4)
    for x in prof.layers:
        x.optimizer_ms = {"adam": 0.25}
    half = cluster(nodes=1, per_node=2, memory_gb=80).model_copy(update={"speed": 0.5})
    opts = PlanOptions(global_batch=16, microbatch_size=2, optimizer="adam", split=[2, 2], method="manual")
    plan, new, again = _refit(prof, half, opts, lambda p: [st.predicted.optimizer_ms for st in p.stages])
    assert [st.predicted.optimizer_ms for st in plan.stages] == pytest.approx([1.0, 1.0])
    assert [x.optimizer_ms["adam"] for x in new.layers] == pytest.approx([0.25] * 4)
    assert [st.predicted.optimizer_ms for st in again.stages] == pytest.approx([1.0, 1.0])

    tp_prof = _profile()
    for x in tp_prof.layers:
        x.optimizer_ms = {"sgd": 1.0}
    opts = PlanOptions(global_batch=8, microbatch_size=2, optimizer="sgd", method="manual", split=[2], tp=[2])
    plan, new, again = _refit(tp_prof, _cluster(mem_gb=80), opts,
                              lambda p: [st.predicted.optimizer_ms for st in p.stages])
    assert [x.optimizer_ms["sgd"] for x in new.layers] == pytest.approx([1.0, 1.0])
    assert again.stages[0].predicted.optimizer_ms == pytest.approx(plan.stages[0].predicted.optimizer_ms)


def test_refine_shares_out_a_step_at_the_profiles_speed() -> None:
    """No figure in the profile: the step measured on half-speed devices is twice the profile's."""
    prof = chain_profile([1.0, 1.0], params=[3 * 10**6, 10**6])
    half = cluster(nodes=1, per_node=1, memory_gb=80).model_copy(update={"speed": 0.5})
    opts = PlanOptions(global_batch=16, microbatch_size=2, optimizer="adam", split=[2], method="manual")
    _, new, again = _refit(prof, half, opts, lambda p: [2.0])
    assert [x.optimizer_ms for x in new.layers] == [{"adam": 0.75}, {"adam": 0.25}]
    assert again.stages[0].predicted.optimizer_ms == pytest.approx(2.0)
