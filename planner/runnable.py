"""What the runtime executes: a plan.json checked for consistency, its devices renumbered as the
process ranks 0..n-1.

The planner numbers devices as ranks of the whole cluster and may leave some idle (on a mixed
cluster the fast devices do the work); the runtime starts one process per *used* device.
Process rank i plays the i-th used device in cluster order (`device_of_rank[i]`).

A plan file can be edited by hand, so everything the runtime relies on is checked here, before
any process starts: stage order, devices, the schedule's generator, and that every rank's
action list belongs to its stage and replica (microbatch j on replica j mod r), runs every
forward and backward once and cannot deadlock (`planner.validate`).
"""

from __future__ import annotations

import difflib

from planner.actions import Action, parse_actions
from planner.errors import PipeplanError
from planner.formats import Plan, PlanStage
from planner.schedules import generate, generator_deferred, tp_leaders, with_tp_ranks
from planner.validate import ScheduleError, format_grid, validate


def _generated(plan: Plan, stage_devices: list[list[int]]) -> dict[int, list[Action]]:
    """Per process rank, the actions the plan's schedule generator gives (`plan.generator`)."""
    assert plan.generator is not None
    tps = [st.tp for st in plan.stages]
    return with_tp_ranks(generate(plan.generator.name, tp_leaders(stage_devices, tps), plan.num_microbatches,
                                  generator_deferred(plan.generator, len(plan.stages))), stage_devices, tps)


def _actions(plan: Plan, rank_of: dict[int, int], stage_devices: list[list[int]]) -> dict[int, list[Action]]:
    m = plan.num_microbatches
    # checked also where the explicit lists are what runs
    if plan.generator is not None:
        generator_deferred(plan.generator, len(plan.stages))
    if plan.rank_actions is None:
        assert plan.generator is not None  # Plan's validator requires one of the two
        if plan.generator.name != plan.schedule:
            raise PipeplanError(f"plan: schedule is {plan.schedule!r} but its generator is "
                                f"{plan.generator.name!r}; make the plan again")
        gm = plan.generator.params.get("num_microbatches", m)
        if gm != m:
            raise PipeplanError(f"plan: num_microbatches is {m} but the schedule generator's is "
                                f"{gm}; make the plan again")
        return _generated(plan, stage_devices)
    try:
        keys = {int(k): k for k in plan.rank_actions}
    except ValueError:
        raise PipeplanError("plan: rank_actions must be keyed by device numbers") from None
    if set(keys) != set(rank_of):
        raise PipeplanError(
            f"plan: rank_actions has devices {sorted(keys)} but the stages use devices "
            f"{sorted(rank_of)}; every device of a stage needs its action list, and only those")
    try:
        out = {rank_of[d]: parse_actions(plan.rank_actions[k]) for d, k in keys.items()}
    except ValueError as exc:
        raise PipeplanError(f"plan: rank_actions: {exc}") from None
    if plan.schedule != "zb-h1" and (w := next((a for acts in out.values() for a in acts if a.kind == "W"),
                                               None)) is not None:
        raise PipeplanError(f"plan: rank_actions has {w}, a W (weight gradient) action, but the "
                            f"schedule is {plan.schedule}: W actions are ZB-H1's; make the plan again")
    return out


# top-level keys beyond Plan's fields that pipeplan reads: the planner writes the first,
# `runnable_plan` sets the second
PLAN_EXTRA_KEYS = ("granularity", "device_of_rank", "profile_batch_size")


def unread_keys(plan: Plan) -> list[str]:
    """One line per key of the plan or of a stage that this pipeplan does not read: a hand
    edit's typo ("recomput": true runs without recomputation; "recompute": true at the top
    level recomputes nothing) or a newer pipeplan's field. A warning, not an error: plan files
    stay open to fields added later. The planner writes none."""
    out = []
    top = sorted([*Plan.model_fields, *PLAN_EXTRA_KEYS])
    stage_keys = sorted(PlanStage.model_fields)
    for key in sorted(set(plan.model_extra or {}) - set(PLAN_EXTRA_KEYS)):
        near = difflib.get_close_matches(key, top, n=1)
        where = ("; it is a stage's key: set it on each stage that should have it"
                 if key in stage_keys else f"; did you mean {near[0]!r}?" if near else "")
        out.append(f"plan: the plan has {key!r}, which this pipeplan does not read (it has no "
                   f"effect){where}")
    for st in plan.stages:
        for key in sorted(st.model_extra or {}):
            near = difflib.get_close_matches(key, stage_keys, n=1)
            out.append(f"plan: stage {st.index} has {key!r}, which this pipeplan does not read "
                       f"(it has no effect)" + (f"; did you mean {near[0]!r}?" if near else ""))
    return out


def not_as_generated(plan: Plan) -> list[str]:
    """One line where the plan's explicit action lists are not what its schedule's generator
    gives (a hand edit: `"schedule": "gpipe"` over 1F1B lists ran without a word): they run as
    listed, which the plan's prediction was not made for. A warning: edited lists that pass
    the checks are the user's to run. Empty for every plan the planner writes."""
    if plan.rank_actions is None or plan.generator is None:
        return []
    if plan.generator.name != plan.schedule:
        return [f"plan: schedule is {plan.schedule!r} but its generator is {plan.generator.name!r} "
                "and its rank_actions run as listed; make the plan again with --schedule "
                f"{plan.schedule}"]
    rank_of = process_ranks(plan)
    try:
        made = _generated(plan, [[rank_of[d] for d in st.devices] for st in plan.stages])
        listed = {rank_of[int(k)]: parse_actions(v) for k, v in plan.rank_actions.items()}
    except (ValueError, KeyError, PipeplanError):
        return []  # what `runnable_plan` refuses, it names
    if made == listed:
        return []
    differ = sorted(d for d, r in rank_of.items() if made.get(r) != listed.get(r))
    return [f"plan: the rank_actions of device(s) {differ[:8]}{' ...' if len(differ) > 8 else ''} are not "
            f"the {plan.schedule} schedule its generator gives (edited by hand?); they run as listed, "
            "and the plan's predicted time is not theirs: `planner simulate` prices them"]


def plan_warnings(plan: Plan) -> list[str]:
    """What runs, but not as written or made: unread keys and hand-edited action lists."""
    return [*unread_keys(plan), *not_as_generated(plan)]


def process_ranks(plan: Plan) -> dict[int, int]:
    """Cluster device -> the process rank that plays it: rank i plays the i-th device the plan
    uses, in cluster order (idle devices get no process)."""
    return {d: i for i, d in enumerate(sorted(d for st in plan.stages for d in st.devices))}


def runnable_plan(plan: Plan) -> Plan:
    """`plan` checked and renumbered for execution (see the module docstring); a PipeplanError
    says what is inconsistent."""
    S = len(plan.stages)
    seen: dict[str, int] = {}
    for st in plan.stages:  # (the runtime refused it against the model; simulate and refine ran it)
        for name in st.layers:
            if name in seen:
                where = "twice" if seen[name] == st.index else f"in stages {seen[name]} and {st.index}"
                raise PipeplanError(f"plan: layer {name!r} is named {where}; each layer belongs "
                                    "to one stage, once: make the plan again")
            seen[name] = st.index
    for i, st in enumerate(plan.stages):
        if st.index != i:
            raise PipeplanError(f"plan: stages[{i}] has index {st.index}; list the stages in "
                                f"order, with indices 0..{S - 1}")
        if st.tp > 1 and st.recompute:  # (`plan` refuses it; a hand edit ran unpriced)
            raise PipeplanError(f"plan: stage {i} is tensor-parallel (tp {st.tp}) and recomputed; "
                                "recomputation of a tensor-parallel stage is not supported yet: set "
                                "its recompute to false, or plan it with --tp 1")
        for d in st.devices:
            if not 0 <= d < plan.cluster.num_devices:
                raise PipeplanError(f"plan: stage {i} uses device {d} but its cluster has "
                                    f"{plan.cluster.num_devices} devices (0..{plan.cluster.num_devices - 1})")
    rank_of = process_ranks(plan)
    used = list(rank_of)
    stage_devices = [[rank_of[d] for d in st.devices] for st in plan.stages]
    schedule = _actions(plan, rank_of, stage_devices)

    for s, ranks in enumerate(stage_devices):
        tp = plan.stages[s].tp
        r = len(ranks) // tp
        for i, rank in enumerate(ranks):
            k = i // tp
            for step, a in enumerate(schedule[rank]):
                if a.stage != s or a.mb % r != k:
                    raise ScheduleError(
                        f"invalid schedule: rank {rank} (device {used[rank]}) is replica {k} of "
                        f"stage {s}, which runs stage {s}'s microbatches j with j mod {r} == {k}, "
                        f"but its step {step} is {a}\n{format_grid(schedule, [(rank, step)])}")
    leaders = {r for ranks, st in zip(stage_devices, plan.stages, strict=True) for r in ranks[::st.tp]}
    validate({r: a for r, a in schedule.items() if r in leaders}, S, plan.num_microbatches)

    stages = [st.model_copy(update={"devices": devs}) for st, devs in zip(plan.stages, stage_devices, strict=True)]
    rank_actions = None if plan.rank_actions is None else {
        str(rank_of[int(k)]): v for k, v in plan.rank_actions.items()}
    return plan.model_copy(update={"stages": stages, "rank_actions": rank_actions,
                                   "device_of_rank": used})
