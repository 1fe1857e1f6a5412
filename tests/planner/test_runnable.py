"""The plan as the runtime executes it: idle devices renumbered away, hand edits caught."""

from __future__ import annotations

import pytest

from planner.errors import PipeplanError
from planner.formats import Cluster, PlanOptions
from planner.runnable import runnable_plan
from planner.schedules import actions_for_rank
from planner.solve import make_plan
from planner.validate import ScheduleError
from tests.planner.helpers import chain_profile, cluster


def _plan(**kw):
    profile = chain_profile([1.0] * 6)
    options = PlanOptions(global_batch=8, microbatch_size=1, method="manual", split=[3, 3],
                          replicas=[2, 1], **kw)
    return make_plan(profile, cluster(per_node=3), options)


def test_idle_devices_are_renumbered_to_process_ranks() -> None:
    # a mixed cluster: the planner puts the work on the fast devices 2..3 and leaves 0..1 idle
    mixed = Cluster.model_validate({
        "nodes": [{"name": "slow", "devices": 2, "device_memory_gb": 16, "speed": 0.1},
                  {"name": "fast", "devices": 2, "device_memory_gb": 16, "speed": 1.0}],
        "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 100})
    plan = make_plan(chain_profile([1.0] * 6), mixed,
                     PlanOptions(global_batch=4, microbatch_size=1, method="cpsat", time_limit_s=5))
    used = sorted(d for st in plan.stages for d in st.devices)
    assert used != list(range(len(used)))  # the case that needs renumbering
    run = runnable_plan(plan)
    assert sorted(d for st in run.stages for d in st.devices) == list(range(len(used)))
    assert run.device_of_rank == used
    for rank, device in enumerate(used):
        assert actions_for_rank(run, rank) == actions_for_rank(plan, device)


def test_swapped_replica_lists_are_rejected() -> None:
    plan = _plan()
    a = dict(plan.rank_actions)
    a["0"], a["1"] = a["1"], a["0"]  # replica 0 would run replica 1's microbatches
    with pytest.raises(ScheduleError, match="replica 0 of stage 0"):
        runnable_plan(plan.model_copy(update={"rank_actions": a}))


def test_a_dropped_action_is_rejected() -> None:
    plan = _plan()
    a = dict(plan.rank_actions)
    a["2"] = a["2"][:-1]
    with pytest.raises(ScheduleError, match="1B7, which no rank runs"):
        runnable_plan(plan.model_copy(update={"rank_actions": a}))


def test_devices_outside_the_cluster_and_missing_lists_are_rejected() -> None:
    plan = _plan()
    stages = [plan.stages[0].model_copy(update={"devices": [0, 5]}), plan.stages[1]]
    with pytest.raises(PipeplanError, match="uses device 5 but its cluster has 3 devices"):
        runnable_plan(plan.model_copy(update={"stages": stages}))
    a = {k: v for k, v in plan.rank_actions.items() if k != "1"}
    with pytest.raises(PipeplanError, match="every device of a stage needs its action list"):
        runnable_plan(plan.model_copy(update={"rank_actions": a}))


def test_generator_form_is_checked_and_expanded() -> None:
    plan = _plan().model_copy(update={"rank_actions": None})
    run = runnable_plan(plan)
    assert [len(actions_for_rank(run, r)) for r in range(3)] == [8, 8, 16]
    bad = plan.model_copy(update={"generator": plan.generator.model_copy(update={"name": "gpipe"})})
    with pytest.raises(PipeplanError, match="generator"):
        runnable_plan(bad)


def test_a_stage_key_the_runtime_does_not_read_is_named_with_the_one_meant() -> None:
    plan = _plan()
    from planner.formats import Plan
    from planner.runnable import unread_keys

    # a plan as the planner writes it, read back: nothing unread
    assert unread_keys(Plan.model_validate_json(plan.model_dump_json())) == []
    edited = plan.model_dump(mode="json")
    edited["stages"][1]["recomput"] = True  # the typo: the stage would run without recomputation
    edited["stages"][0]["future_field"] = 3
    edited["recompute"] = True  # a stage's key at the top level: no stage recomputes
    edited["schedul"] = "gpipe"
    lines = unread_keys(runnable_plan(Plan.model_validate(edited)))
    assert len(lines) == 4
    assert "the plan has 'recompute'" in lines[0] and "set it on each stage" in lines[0]
    assert "the plan has 'schedul'" in lines[1] and "did you mean 'schedule'?" in lines[1]
    assert "stage 0" in lines[2] and "'future_field'" in lines[2] and "did you mean" not in lines[2]
    assert "stage 1" in lines[3] and "'recomput'" in lines[3] and "did you mean 'recompute'?" in lines[3]


def test_a_recomputed_tensor_parallel_stage_is_refused_as_plan_refuses_it() -> None:
    """`plan` refuses recomputation on a TP stage; set by hand, the runtime ran it with costs
    nobody priced (an outside review)."""
    plan = _plan()
    stages = [plan.stages[0].model_copy(update={"tp": 2, "replicas": 1, "recompute": True}), plan.stages[1]]
    with pytest.raises(PipeplanError, match="stage 0 is tensor-parallel .tp 2. and recomputed"):
        runnable_plan(plan.model_copy(update={"stages": stages}))


def test_a_layer_in_two_stages_is_refused() -> None:
    """`simulate` and `refine` took a plan whose stage 1 also named a layer of stage 0 (the
    runtime refused it against the model): an outside review."""
    plan = _plan()
    first = plan.stages[0].layers[0]
    stages = [plan.stages[0], plan.stages[1].model_copy(update={"layers": [*plan.stages[1].layers, first]})]
    with pytest.raises(PipeplanError, match=f"layer '{first}' is named in stages 0 and 1"):
        runnable_plan(plan.model_copy(update={"stages": stages}))
    stages = [plan.stages[0].model_copy(update={"layers": [first, *plan.stages[0].layers]}), plan.stages[1]]
    with pytest.raises(PipeplanError, match=f"layer '{first}' is named twice"):
        runnable_plan(plan.model_copy(update={"stages": stages}))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_action_lists_edited_off_their_schedule_are_warned_about(schedule: str) -> None:
    """A plan whose rank_actions are not what its schedule gives (a hand edit: `"schedule":
    "gpipe"` over 1F1B lists ran without a word; an outside review) is warned about; no plan
    the planner writes is (replicas, idle devices renumbered, ZB-H1's deferred and fused W's,
    tensor parallelism)."""
    from planner.runnable import not_as_generated
    from tests.planner.test_tensor_parallel_cost import _profile as tp_profile

    made = [_plan(schedule=schedule),
            make_plan(chain_profile([1.0, 3.0, 1.0, 2.0, 1.0, 1.0]), cluster(per_node=4),
                      PlanOptions(global_batch=8, microbatch_size=1, method="cpsat", time_limit_s=2,
                                  schedule=schedule)),
            make_plan(tp_profile(), cluster(per_node=4, memory_gb=80.0),
                      PlanOptions(global_batch=8, microbatch_size=4, method="manual", split=[1, 1],
                                  replicas=[1, 1], tp=[2, 1], schedule=schedule))]
    mixed = Cluster.model_validate({
        "nodes": [{"name": "slow", "devices": 2, "device_memory_gb": 16, "speed": 0.1},
                  {"name": "fast", "devices": 2, "device_memory_gb": 16, "speed": 1.0}],
        "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 100})
    made.append(make_plan(chain_profile([1.0] * 6), mixed, PlanOptions(
        global_batch=4, microbatch_size=1, method="cpsat", time_limit_s=2, schedule=schedule)))
    for plan in made:
        assert not_as_generated(plan) == [] and not_as_generated(runnable_plan(plan)) == []
    plan = made[0]
    other = {"1f1b": "gpipe", "gpipe": "1f1b", "zb-h1": "1f1b"}[schedule]
    relabelled = plan.model_copy(update={"schedule": other})
    assert "but its generator is" in not_as_generated(relabelled)[0]
    a = dict(plan.rank_actions)
    a["2"] = [a["2"][1], a["2"][0], *a["2"][2:]]  # stage 1's first two actions swapped
    lines = not_as_generated(plan.model_copy(update={"rank_actions": a}))
    assert len(lines) == 1 and "device(s) [2]" in lines[0] and "planner simulate" in lines[0], lines
