"""ZB-H1 (zero bubble) and per-stage recomputation in the planner: the W action, the generator,
the validator, the simulator against the paper's closed forms, the cost model and the plan."""

from __future__ import annotations

import json
import re

import pytest
from helpers import chain_profile, cluster, equal_costs

from planner.actions import Action
from planner.build import evaluate
from planner.cost import layer_table
from planner.errors import PipeplanError
from planner.formats import Plan, PlanOptions
from planner.p2p_order import check_plan, check_schedule
from planner.partition import Candidate, StageChoice
from planner.schedules import generate, plan_actions
from planner.simulator import simulate, simulate_costs
from planner.solve import make_plan
from planner.trace import chrome_trace, text_timeline
from planner.validate import ScheduleError, validate


def _split(costs, w_ms):
    from dataclasses import replace

    return replace(costs, bwd_weight_ms=(w_ms,) * costs.num_stages)


def test_w_action_parses_back():
    a = Action.parse("1W3")
    assert a == Action(1, "W", 3) and str(a) == "1W3"
    with pytest.raises(ValueError):
        Action.parse("1X3")


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 13])
def test_zb_h1_is_valid_and_reaches_the_papers_makespan(p, m):
    # F = B = W = 1: 1F1B's full backward is B + W = 2
    devs = [(s,) for s in range(p)]
    zb = validate(generate("zb-h1", devs, m), p, m)
    costs = _split(equal_costs(p, m, fwd_ms=1.0, bwd_ms=2.0, act_bytes=1.0), 1.0)
    sim = simulate_costs(costs, zb)
    one = simulate_costs(costs, generate("1f1b", devs, m))
    if m >= p:  # the closed forms assume a full pipeline
        assert sim.iteration_ms == pytest.approx(m * 3 + (p - 1) * (1 + 1 - 1))
        assert one.iteration_ms == pytest.approx(m * 3 + (p - 1) * 3)
    assert sim.iteration_ms <= one.iteration_ms + 1e-9
    # memory: ZB-H1 never holds more microbatches than 1F1B's busiest rank
    assert max(sim.peak_inflight.values()) <= max(one.peak_inflight.values())
    assert max(sim.peak_memory_bytes.values()) <= max(one.peak_memory_bytes.values())
    # every rank: same F / B order as 1F1B, one W per B after it
    for r, acts in zb.items():
        assert [a for a in acts if a.kind != "W"] == generate("1f1b", devs, m)[r]


@pytest.mark.parametrize("F,B,W", [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (2.0, 1.0, 1.0), (1.0, 0.7, 1.3)])
def test_zb_h1_never_below_its_ideal_and_never_worse_than_1f1b(F, B, W):
    p, m = 4, 8
    devs = [(s,) for s in range(p)]
    costs = _split(equal_costs(p, m, fwd_ms=F, bwd_ms=B + W), W)
    zb = simulate_costs(costs, generate("zb-h1", devs, m)).iteration_ms
    one = simulate_costs(costs, generate("1f1b", devs, m)).iteration_ms
    assert zb >= m * (F + B + W) + (p - 1) * max(F + B - W, 0) - 1e-9
    assert zb <= one + 1e-9


@pytest.mark.parametrize("replicas", [[2, 1], [1, 2], [2, 2, 1], [1, 3, 2, 1]])
def test_zb_h1_with_replicas_is_valid_and_nccl_safe(replicas):
    devs, r = [], 0
    for k in replicas:
        devs.append(list(range(r, r + k)))
        r += k
    for m in (1, 4, 6, 12):
        sched = generate("zb-h1", devs, m)
        validate(sched, len(devs), m)
        check_schedule(sched, devs)
        costs = equal_costs(len(devs), m)
        one = simulate_costs(costs, generate("1f1b", devs, m))
        zb = simulate_costs(costs, sched)
        assert max(zb.peak_inflight.values()) <= max(one.peak_inflight.values())


def test_validator_rejects_w_before_b_a_missing_w_and_too_much_in_flight():
    devs = [(0,), (1,)]
    good = generate("zb-h1", devs, 3)
    bad = {r: list(a) for r, a in good.items()}
    i, k = bad[1].index(Action(1, "B", 0)), bad[1].index(Action(1, "W", 0))
    bad[1][i], bad[1][k] = bad[1][k], bad[1][i]
    with pytest.raises(ScheduleError, match="weight gradient 1W0 before its input gradient 1B0"):
        validate(bad, 2, 3)
    bad = {r: [a for a in acts if a != Action(0, "W", 2)] for r, acts in good.items()}
    with pytest.raises(ScheduleError, match="0B2 has no weight gradient 0W2"):
        validate(bad, 2, 3)
    validate(good, 2, 3, max_inflight={0: 2, 1: 2})
    with pytest.raises(ScheduleError, match="rank 1 .* more than the 1"):
        validate(good, 2, 3, max_inflight={0: 2, 1: 1})


def test_trace_gives_w_its_own_colour_and_letter():
    devs = [(0,), (1,)]
    sim = simulate_costs(equal_costs(2, 2), generate("zb-h1", devs, 2))
    evs = [e for e in chrome_trace(sim)["traceEvents"] if e["ph"] == "X"]
    colours = {e["cat"]: e["cname"] for e in evs}
    assert set(colours) == {"F", "B", "W"} and len(set(colours.values())) == 3
    assert "A-Z its weight gradient" in text_timeline(sim)


def test_plan_with_zb_h1_round_trips_and_simulates_the_same(tmp_path):
    profile = chain_profile([1.0] * 8, bwd=[2.0] * 8)
    options = PlanOptions(global_batch=16, microbatch_size=2, schedule="zb-h1", method="manual",
                          split=[2, 2, 2, 2], optimizer="sgd")
    plan = make_plan(profile, cluster(per_node=4), options)
    assert plan.schedule == "zb-h1" and any("W" in a for acts in plan.rank_actions.values() for a in acts)
    again = Plan.model_validate(json.loads(plan.model_dump_json()))
    assert simulate(again).iteration_ms == pytest.approx(plan.predicted.iteration_ms)
    check_plan(again)
    one = make_plan(profile, cluster(per_node=4), options.model_copy(update={"schedule": "1f1b"}))
    assert plan.predicted.iteration_ms < one.predicted.iteration_ms
    # no measured split: a layer with parameters is half B, half W (planner.cost); the first
    # stage sends no gradient back, so its whole backward is W
    st = plan.stages[1].predicted
    assert st.bwd_input_ms == pytest.approx(st.bwd_weight_ms) == pytest.approx(st.bwd_ms / 2)
    first = plan.stages[0].predicted
    assert first.bwd_input_ms == 0 and first.bwd_weight_ms == pytest.approx(first.bwd_ms)
    assert validate(plan_actions(again), 4, 8)


def test_measured_b_w_split_is_used():
    profile = chain_profile([1.0] * 4, bwd=[2.0] * 4)
    for layer in profile.layers:
        layer.bwd_input_ms, layer.bwd_weight_ms = 1.5, 0.5
    table = layer_table(profile)
    assert table.bwd_weight_ms(0, 4) == pytest.approx(2.0)
    assert table.bwd_ms(0, 4) - table.bwd_weight_ms(0, 4) == pytest.approx(6.0)
    no_params = chain_profile([1.0] * 2, params=[0, 0])
    assert layer_table(no_params).bwd_weight_ms(0, 2) == 0.0


def _cand(recompute: tuple[bool, ...]) -> Candidate:
    return Candidate(tuple(StageChoice(2 * s, 2 * s + 2, (s,), recompute=recompute[s]) for s in range(2)),
                     microbatch_size=8, num_microbatches=4)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_recompute_costs_a_forward_and_saves_memory(schedule):
    profile = chain_profile([1.0] * 4, bwd=[2.0] * 4, act=[1000] * 4, out=[50] * 4)
    table = layer_table(profile)
    opts = PlanOptions(global_batch=32, microbatch_size=8, schedule=schedule, method="manual",
                       optimizer="sgd")
    base = evaluate(table, cluster(per_node=2), _cand((False, False)), opts)
    rec = evaluate(table, cluster(per_node=2), _cand((True, False)), opts)
    assert rec.costs.bwd_ms[0] == pytest.approx(base.costs.bwd_ms[0] + base.costs.fwd_ms[0])
    assert rec.costs.bwd_ms[1] == pytest.approx(base.costs.bwd_ms[1])
    # kept per microbatch: the blocks' inputs (the model input 8 B and l0's output 50 B)
    assert rec.costs.activation_bytes_per_microbatch[0] == pytest.approx(58)
    assert rec.stage_memory_bytes[0] < base.stage_memory_bytes[0]
    if schedule == "zb-h1":  # stage 1 defers W's only up to the busiest stage's 1F1B peak,
        # which recomputing stage 0 lowered
        assert rec.stage_memory_bytes[1] <= base.stage_memory_bytes[1]
    else:
        assert rec.stage_memory_bytes[1] == pytest.approx(base.stage_memory_bytes[1])
    assert rec.iteration_ms > base.iteration_ms


def _files(tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_text(chain_profile([1.0] * 6, act=[10**9] * 6, batch_size=8).model_dump_json())
    cl = tmp_path / "cluster.json"
    cl.write_text(json.dumps({"nodes": 1, "devices_per_node": 3, "device_memory_gb": 16,
                              "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}))
    return str(prof), str(cl)


def test_plan_cli_zb_h1_and_manual_recompute(tmp_path, capsys):
    from planner.cli import main

    prof, cl = _files(tmp_path)
    out = tmp_path / "plan.json"
    trace = tmp_path / "trace.json"
    common = ["plan", prof, "--cluster", cl, "--global-batch", "16", "--microbatch-size", "8",
              "--method", "manual", "--split", "2,2,2", "--optimizer", "sgd", "-o", str(out)]
    assert main([*common, "--schedule", "zb-h1", "--recompute", "1,0,1", "--trace", str(trace)]) == 0
    plan = Plan.model_validate_json(out.read_text())
    assert plan.schedule == "zb-h1" and [s.recompute for s in plan.stages] == [True, False, True]
    cats = {e.get("cat") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"F", "B", "W"} <= cats
    # 1 GB of activations per layer and microbatch, 16 GB devices: 1F1B holds 3 microbatches of
    # 2 GB on stage 0 without recomputation (fits), the recomputed stage keeps only inputs
    assert plan.stages[0].predicted.memory_bytes < plan.stages[1].predicted.memory_bytes
    capsys.readouterr()
    assert main([*common, "--recompute", "1,0"]) != 0
    assert "one flag (0 or 1) per stage" in capsys.readouterr().err
    assert main([*common, "--recompute", "1,0,0", "--no-recompute"]) != 0
    assert "contradict" in capsys.readouterr().err


def _peaks(costs, schedule, deferred=None):
    sim = simulate_costs(costs, generate(schedule, costs.stage_devices, costs.num_microbatches, deferred))
    return [sim.peak_memory_bytes[devs[0]] for devs in costs.stage_devices]


def test_zb_h1_defers_ws_only_within_the_busiest_stages_1f1b_peak():
    from dataclasses import replace

    from planner.schedules import FUSED, zb_h1_deferred_w, zb_h1_memory_deferrals

    p, m = 4, 8
    default = [zb_h1_deferred_w(m, [1] * p, s) for s in range(p)]
    # equal stages: the paper's ZB-H1 (stage s defers s W's) already holds no more than 1F1B;
    # stage 0, deferring nothing and sending no gradient, runs one backward
    equal = equal_costs(p, m, act_bytes=10.0)
    assert default == [0, 1, 2, 3]
    assert zb_h1_memory_deferrals(equal) == [FUSED, 1, 2, 3]
    assert max(_peaks(equal, "zb-h1")) == pytest.approx(max(_peaks(equal, "1f1b")))
    assert _peaks(equal, "zb-h1", [FUSED, 1, 2, 3]) == _peaks(equal, "zb-h1")
    # stage 2 keeps 5x the bytes per microbatch, and every stage's W gradients are 2 more
    # bytes: deferring 2 W's there would exceed 1F1B's peak (stage 2's own 1F1B peak, 2 x 50),
    # and so would deferring none (50 + 52): it runs one backward
    costs = replace(equal, activation_bytes_per_microbatch=(10.0, 10.0, 50.0, 10.0),
                    weight_hold_bytes_per_microbatch=(12.0, 12.0, 52.0, 12.0))
    d = zb_h1_memory_deferrals(costs)
    assert d[:3] == [FUSED, 1, FUSED]
    one, zb = _peaks(costs, "1f1b"), _peaks(costs, "zb-h1", d)
    uncapped = _peaks(costs, "zb-h1")
    assert max(uncapped) > max(one)
    assert max(zb) <= max(one)
    # the counts travel in the plan's generator, and the plan's actions use them
    from planner.schedules import generator_deferred, plan_schedule_fields

    actions, gen = plan_schedule_fields("zb-h1", [[0], [1], [2], [3]], m, deferred=d)
    assert gen.params["deferred_w"] == [0, 1, 0, 3] and gen.params["fused_backward"] == [0, 2]
    assert generator_deferred(gen) == d
    assert actions == {str(r): [str(a) for a in acts]
                       for r, acts in generate("zb-h1", [[0], [1], [2], [3]], m, d).items()}
    assert not any(a.endswith(f"W{j}") for a in actions["0"] for j in range(m))


def test_zb_h1_defers_ws_only_within_each_stages_own_memory_limit():
    """Equal stages, the paper's deferrals [0, 1, 2, 3] within the busiest 1F1B peak (stage 0's:
    100 + 4 x 10 bytes; stage s's own is 140 - 10 s). Stages 2 and 3 on devices of 125 bytes,
    below the busiest peak: each defers only the W's that keep it within 125 (one W more holds
    10 bytes more), the others as before."""
    from dataclasses import replace

    from planner.schedules import FUSED, zb_h1_memory_deferrals

    p, m = 4, 8
    equal = equal_costs(p, m, act_bytes=10.0)
    assert zb_h1_memory_deferrals(equal) == [FUSED, 1, 2, 3]
    assert _peaks(equal, "zb-h1", [FUSED, 1, 2, 3]) == [140.0] * 4
    costs = replace(equal, memory_limit_bytes=(1e12, 1e12, 125.0, 125.0))
    d = zb_h1_memory_deferrals(costs)
    assert d == [FUSED, 1, 0, 1]
    assert _peaks(costs, "zb-h1", d) == [140.0, 140.0, 120.0, 120.0]
    assert _peaks(costs, "zb-h1", [FUSED, 1, 1, 1])[2] > 125.0
    assert _peaks(costs, "zb-h1", [FUSED, 1, 0, 2])[3] > 125.0


def test_zb_h1_on_devices_of_two_sizes_is_the_brute_force_optimum():
    """Two nodes, 2 GB and 16 GB devices (the slow ones twice as slow), ZB-H1, Adam: the stage
    on a 2 GB device deferred W's up to the 1F1B peak of a stage on a 16 GB one and overflowed,
    so every plan that fitted recomputed; and the enumeration's proof, run because the bound's
    DP (memory at the largest device) needed no recomputed variant, called a plan 10.8 % slower
    than the brute force's optimal (brute-force seed 6063 of `benchmarks/brute_force.py`)."""
    from planner.search import solve
    from tests.planner.cpsat_reference import brute_force
    from tests.planner.test_search_joint import coupled_instance

    profile, cluster, options = coupled_instance(6063)
    assert options.schedule == "zb-h1" and len({n.device_memory_gb for n in cluster.nodes}) == 2
    ref = brute_force(profile, cluster, options, [options.microbatch_size])
    cand = solve(profile, cluster, options)
    ev = evaluate(layer_table(profile), cluster, cand, options)
    assert ev.fits
    assert ev.iteration_ms <= ref.iteration_ms * (1 + 1e-9), (ev.iteration_ms, ref.iteration_ms)
    assert cand.solver["bound"] <= ref.iteration_ms * (1 + 1e-9)


def test_zb_h1_stage_that_would_exceed_the_1f1b_peak_deferring_nothing_runs_one_backward():
    """Equal stages whose W gradients are large: deferring nothing, a split stage s > 0 holds
    one microbatch's W gradients above its 1F1B peak, which is the busiest (stage 0's holds
    one microbatch more, but less per microbatch): it fuses, and every stage stays within."""
    from dataclasses import replace

    from planner.schedules import FUSED, zb_h1_memory_deferrals

    p, m = 4, 8
    costs = replace(equal_costs(p, m, act_bytes=10.0),
                    activation_bytes_per_microbatch=(5.0, 10.0, 10.0, 10.0),
                    weight_hold_bytes_per_microbatch=(5.0, 25.0, 25.0, 25.0))
    one = _peaks(costs, "1f1b")
    assert max(one) == one[1] == 100.0 + 3 * 10.0  # static + 3 in flight
    d = zb_h1_memory_deferrals(costs)
    assert d[0] == FUSED and d[1] == FUSED  # split with 0 deferred: 2 x 10 + 25 = 45 > 30
    zb = _peaks(costs, "zb-h1", d)
    assert max(zb) <= max(one) and zb[1] == one[1]
    split = _peaks(costs, "zb-h1", [0 if x == FUSED else x for x in d])
    assert split[1] > max(one)
    # the fused stage's previous stage gets its gradient after B + W: never faster
    fast = simulate_costs(costs, generate("zb-h1", costs.stage_devices, m, [0 if x == FUSED else x for x in d]))
    slow = simulate_costs(costs, generate("zb-h1", costs.stage_devices, m, d))
    assert slow.iteration_ms >= fast.iteration_ms


def test_stored_generator_rejects_what_the_planner_does_not_write():
    """A hand-edited generator is refused in one line, never ignored: `fused_backward` and
    `deferred_w` are ZB-H1's, a fused stage defers 0, one count per stage."""
    from planner.formats import ScheduleGenerator
    from planner.schedules import FUSED, generator_deferred

    def gen(name="zb-h1", **params):
        return ScheduleGenerator(name=name, params=params)

    bad = [
        (gen(deferred_w=[-1, 0]), "deferred_w must give one count >= 0"),
        (gen(deferred_w=1), "deferred_w must give one count >= 0"),
        (gen(deferred_w=[0, 0], fused_backward=[2]), "fused_backward lists stages [2]"),
        (gen(deferred_w=[0, 0], fused_backward=1), "fused_backward lists stages 1"),
        (gen(fused_backward=[0]), "fused_backward needs deferred_w"),
        (gen(deferred_w=[3, 0], fused_backward=[0]), "defers no W"),
        (gen("1f1b", deferred_w=[0, 0]), "are ZB-H1's, not 1f1b's"),
        (gen("gpipe", fused_backward=[0]), "are ZB-H1's, not gpipe's"),
    ]
    for g, message in bad:
        with pytest.raises(PipeplanError, match=re.escape(message)):
            generator_deferred(g, 2)
    # the length against the plan's stages, in the file's own terms
    with pytest.raises(PipeplanError, match=re.escape("deferred_w has 2 counts [0, 1] but the plan has 3")):
        generator_deferred(gen(deferred_w=[0, 1], fused_backward=[0]), 3)
    # a plan from before fused stages: every stage splits
    assert generator_deferred(gen(deferred_w=[0, 1]), 2) == [0, 1]
    assert generator_deferred(gen(deferred_w=[0, 1], fused_backward=[0, 0]), 2) == [FUSED, 1]
    assert generator_deferred(gen("1f1b")) is None


def test_w_actions_in_a_plan_of_another_schedule_are_refused():
    from planner.runnable import runnable_plan

    plan = make_plan(chain_profile([1.0] * 4), cluster(per_node=2),
                     PlanOptions(global_batch=8, microbatch_size=2, method="manual", split=[2, 2],
                                 optimizer="sgd"))
    acts = {r: [*v, v[-1].replace("B", "W")] for r, v in plan.rank_actions.items()}  # a W after its B
    edited = plan.model_copy(update={"rank_actions": acts})
    with pytest.raises(PipeplanError, match="W actions are ZB-H1's"):
        runnable_plan(edited)


def test_w_hold_and_recompute_transient_from_the_profiles_split_bytes():
    # every layer: 1000 B saved (50 of them its input), its W keeps 300 B of gradients of which
    # 50 are its output's gradient; outputs 50 B; microbatch = profile batch (scale 1)
    profile = chain_profile([1.0] * 4, act=[1000] * 4, out=[50] * 4)
    for layer in profile.layers:
        layer.weight_grad_bytes, layer.weight_grad_output_bytes, layer.saved_input_bytes = 300, 50, 50
    table = layer_table(profile)
    opts = PlanOptions(global_batch=32, microbatch_size=8, schedule="zb-h1", method="manual", optimizer="sgd")
    cand = Candidate((StageChoice(0, 2, (0,)), StageChoice(2, 3, (1,)), StageChoice(3, 4, (2,))),
                     microbatch_size=8, num_microbatches=4)
    costs = evaluate(table, cluster(per_node=3), cand, opts).costs
    # stage 0 sends no gradient (W from its outputs): its activations + its outputs' gradients
    assert costs.weight_hold_bytes_per_microbatch[0] == 2000 + 50
    # l2 alone: its W gradients, its output's counted once, as the stage's output gradient
    assert costs.weight_hold_bytes_per_microbatch[1] == 1000 + (300 - 50) + 50
    # the last layer's output gradient (from the loss) stays an intermediate's
    assert costs.weight_hold_bytes_per_microbatch[2] == 1000 + 300
    rec = Candidate((StageChoice(0, 2, (0,)), StageChoice(2, 4, (1,), recompute=True)),
                    microbatch_size=8, num_microbatches=4)
    costs = evaluate(table, cluster(per_node=2), rec, opts).costs
    assert costs.activation_bytes_per_microbatch[1] == 50 + 50  # the blocks' inputs
    assert costs.transient_bytes[1] == 1000 - 50  # a block's recomputation, its input kept already
    assert costs.weight_hold_bytes_per_microbatch[1] == 100  # recomputed: the inputs, no W gradients
