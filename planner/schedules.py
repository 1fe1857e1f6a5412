"""Schedule generators: per global rank, the ordered list of actions it executes.

1F1B is PipeDream-Flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
ICML 2021): warm-up forwards, then one backward / one forward, then the remaining backwards,
and a flush at the end of the iteration. GPipe (Huang et al., NeurIPS 2019): all forwards, then
all backwards. Replica k of a stage with r replicas runs microbatches j with j % r == k, in
increasing order (ARCHITECTURE.md gives the warm-up counts).

ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) splits each backward into
`B` (gradient of the stage's input, on the critical path) and `W` (gradient of its weights).
F and B run in exactly 1F1B's order (same warm-up, so the same number of microbatches between
a forward and its B); each replica defers its W's by up to `zb_h1_deferred_w` (the number of
warm-up forwards of stage 0 minus its own, i.e. s on a chain), the oldest deferred W
running after each B once that many are pending, and the rest after the last B, where they
fill the cool-down bubbles. With F = B = W this gives the paper's makespan
m (F + B + W) + (p - 1)(F + B - W).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.actions import Action, parse_actions
from planner.cost import warmup_1f1b
from planner.errors import PipeplanError
from planner.formats import Plan, ScheduleGenerator

SCHEDULES = ("1f1b", "gpipe", "zb-h1")
EXPLICIT_LIMIT_ACTIONS = 20_000  # above this many actions in total, plans store the generator


def replica_actions(name: str, stage: int, stage_replicas: Sequence[int], replica: int,
                    num_microbatches: int) -> list[Action]:
    """The actions of replica `replica` of stage `stage` (`stage_replicas[s]` = r_s)."""
    mbs = list(range(replica, num_microbatches, stage_replicas[stage]))
    F = [Action(stage, "F", j) for j in mbs]
    B = [Action(stage, "B", j) for j in mbs]
    if name == "gpipe":
        return F + B
    if name not in ("1f1b", "zb-h1"):
        raise PipeplanError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    w = warmup_1f1b(num_microbatches, stage_replicas, stage, replica)
    out = F[:w]
    for i in range(len(mbs) - w):
        out.append(B[i])
        out.append(F[w + i])
    out.extend(B[len(mbs) - w:])
    if name == "zb-h1":
        return with_deferred_w(out, zb_h1_deferred_w(num_microbatches, stage_replicas, stage, replica))
    return out


def zb_h1_deferred_w(num_microbatches: int, stage_replicas: Sequence[int], stage: int,
                     replica: int = 0) -> int:
    """How many W's a ZB-H1 replica may leave pending after a B: stage 0's 1F1B warm-up minus
    its own (s on a chain), so F-to-W in-flight work never exceeds stage 0's 1F1B peak."""
    w0 = max(warmup_1f1b(num_microbatches, stage_replicas, 0, k) for k in range(stage_replicas[0]))
    return max(0, w0 - warmup_1f1b(num_microbatches, stage_replicas, stage, replica))


def with_deferred_w(order: Sequence[Action], deferred: int) -> list[Action]:
    """Insert `W` after the F / B order `order`: after each B the oldest pending W's run until at
    most `deferred` are pending; the rest after the last B."""
    out: list[Action] = []
    pending: list[Action] = []
    for a in order:
        out.append(a)
        if a.kind == "B":
            pending.append(Action(a.stage, "W", a.mb))
            while len(pending) > deferred:
                out.append(pending.pop(0))
    out.extend(pending)
    return out


def generate(name: str, stage_devices: Sequence[Sequence[int]], num_microbatches: int
             ) -> dict[int, list[Action]]:
    """Per global rank, its actions; `stage_devices[s][k]` is the rank of replica k of stage s."""
    if name not in SCHEDULES:
        raise PipeplanError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    replicas = [len(devs) for devs in stage_devices]
    out: dict[int, list[Action]] = {}
    for s, devs in enumerate(stage_devices):
        for k, rank in enumerate(devs):
            out[rank] = replica_actions(name, s, replicas, k, num_microbatches)
    return out


def generate_rank(name: str, stage_devices: Sequence[Sequence[int]], num_microbatches: int,
                  rank: int) -> list[Action]:
    """One rank's actions without generating the others' (what a runtime rank needs)."""
    for s, devs in enumerate(stage_devices):
        if rank in devs:
            return replica_actions(name, s, [len(d) for d in stage_devices],
                                   list(devs).index(rank), num_microbatches)
    raise PipeplanError(f"rank {rank} is not in the plan (it has {sum(map(len, stage_devices))} ranks)")


def total_actions(stage_devices: Sequence[Sequence[int]], num_microbatches: int) -> int:
    return 2 * num_microbatches * len(stage_devices)


def total_actions_for(name: str, stage_devices: Sequence[Sequence[int]], num_microbatches: int) -> int:
    return (3 if name == "zb-h1" else 2) * num_microbatches * len(stage_devices)


def plan_schedule_fields(name: str, stage_devices: Sequence[Sequence[int]], num_microbatches: int,
                         limit: int = EXPLICIT_LIMIT_ACTIONS
                         ) -> tuple[dict[str, list[str]] | None, ScheduleGenerator]:
    """What a plan stores: explicit per-rank action strings when small (else None) and always
    the generator that reproduces them."""
    generator = ScheduleGenerator(name=name, params={"num_microbatches": num_microbatches})  # type: ignore[arg-type]
    if total_actions_for(name, stage_devices, num_microbatches) > limit:
        return None, generator
    lists = generate(name, stage_devices, num_microbatches)
    return {str(r): [str(a) for a in lists[r]] for r in sorted(lists)}, generator


def actions_for_rank(plan: Plan, rank: int) -> list[Action]:
    """What rank `rank` executes: the plan's explicit list, or the generator's."""
    if plan.rank_actions is not None:
        if str(rank) not in plan.rank_actions:
            raise PipeplanError(f"rank {rank} is not in the plan (ranks {', '.join(plan.rank_actions)})")
        return parse_actions(plan.rank_actions[str(rank)])
    assert plan.generator is not None
    m = plan.generator.params.get("num_microbatches", plan.num_microbatches)
    assert isinstance(m, int)
    return generate_rank(plan.generator.name, [s.devices for s in plan.stages], m, rank)


def plan_actions(plan: Plan) -> dict[int, list[Action]]:
    """Every rank's actions of a plan."""
    if plan.rank_actions is not None:
        return {int(r): parse_actions(a) for r, a in plan.rank_actions.items()}
    assert plan.generator is not None
    m = plan.generator.params.get("num_microbatches", plan.num_microbatches)
    assert isinstance(m, int)
    return generate(plan.generator.name, [s.devices for s in plan.stages], m)
