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

That deferral keeps every stage's count of microbatches between F and W within stage 0's 1F1B
count, which is the paper's "same peak memory as 1F1B" only when every stage holds as many
bytes per microbatch. A plan's ZB-H1 therefore defers, per stage, as many W's as keep that
stage's peak memory within the busiest stage's 1F1B peak and within its own device's memory
(`zb_h1_memory_deferrals`, from the cost model's bytes; a microbatch between B and W also holds
its W's gradients) and stores the counts in its generator (`params["deferred_w"]`, one per
stage).

A stage may also run B and W as one backward, 1F1B's, with no W actions (`FUSED`; the plan's
`params["fused_backward"]` lists those stages). Stage 0 does where it defers nothing: its
inputs need no gradient, so its B sends nothing and its W runs the whole backward (one action
per microbatch fewer, the same time). A later stage does where it would exceed the busiest
stage's 1F1B peak even deferring nothing: between its B and W a split backward keeps the
gradients at the intermediates, one microbatch's worth above 1F1B's peak; fused, it holds
1F1B's own, and its previous stage gets the gradient after B + W instead of B. So every
stage of a generated ZB-H1 plan stays within the busiest stage's 1F1B peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

from planner.actions import Action, parse_actions
from planner.cost import PipelineCosts, held_peak, memory_codes, warmup_1f1b
from planner.errors import PipeplanError
from planner.formats import Plan, ScheduleGenerator

SCHEDULES = ("1f1b", "gpipe", "zb-h1")
FUSED = -1  # a ZB-H1 stage's deferral that runs B and W as one backward (no W actions)
EXPLICIT_LIMIT_ACTIONS = 20_000  # above this many actions in total, plans store the generator


def replica_actions(name: str, stage: int, stage_replicas: Sequence[int], replica: int,
                    num_microbatches: int, deferred: int | None = None) -> list[Action]:
    """The actions of replica `replica` of stage `stage` (`stage_replicas[s]` = r_s); ZB-H1
    defers `deferred` W's (None: `zb_h1_deferred_w`; `FUSED`: no W, B is the whole backward).
    A new list each call (the search generates the same ones thousands of times: they are
    kept, `_replica_actions`)."""
    if num_microbatches > CACHED_MICROBATCHES:
        return _make_replica_actions(name, stage, stage_replicas, replica, num_microbatches, deferred)
    return list(_replica_actions(name, stage, tuple(stage_replicas), replica, num_microbatches, deferred))


CACHED_MICROBATCHES = 256  # the cache holds at most 2048 lists of at most 3 x this many actions


@lru_cache(maxsize=2048)
def _replica_actions(name: str, stage: int, stage_replicas: tuple[int, ...], replica: int,
                     num_microbatches: int, deferred: int | None) -> tuple[Action, ...]:
    return tuple(_make_replica_actions(name, stage, stage_replicas, replica, num_microbatches, deferred))


def _make_replica_actions(name: str, stage: int, stage_replicas: Sequence[int], replica: int,
                          num_microbatches: int, deferred: int | None) -> list[Action]:
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
        if deferred is None:
            deferred = zb_h1_deferred_w(num_microbatches, stage_replicas, stage, replica)
        return out if deferred == FUSED else with_deferred_w(out, deferred)
    return out


def memory_representatives(stage_devices: Sequence[Sequence[int]], num_microbatches: int
                           ) -> dict[int, int]:
    """Per rank, a rank of its stage whose generated actions hold the same memory: replicas of
    a stage with as many microbatches run the same kinds of action in the same order (on other
    microbatch ids), so the simulator counts one memory peak per stage and microbatch count."""
    out: dict[int, int] = {}
    for devs in stage_devices:
        r = len(devs)
        for k, rank in enumerate(devs):
            # replicas k < m % r run one microbatch more than the rest
            out[rank] = devs[0] if k < num_microbatches % r or num_microbatches % r == 0 else devs[-1]
    return out


def zb_h1_deferred_w(num_microbatches: int, stage_replicas: Sequence[int], stage: int,
                     replica: int = 0) -> int:
    """How many W's a ZB-H1 replica may leave pending after a B: stage 0's 1F1B warm-up minus
    its own (s on a chain), so F-to-W in-flight work never exceeds stage 0's 1F1B peak."""
    w0 = warmup_1f1b(num_microbatches, stage_replicas, 0, 0)  # replica 0 runs the most
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


def _replica_kinds(num_microbatches: int, replicas: int) -> tuple[int, ...]:
    """One replica of each kind: replicas with as many microbatches run the same actions on
    other microbatch ids (the first `m % r` run one more than the rest)."""
    return (0,) if num_microbatches % replicas == 0 or replicas == 1 else (0, replicas - 1)


@lru_cache(maxsize=4096)
def _memory_codes(name: str, stage: int, stage_replicas: tuple[int, ...], replica: int,
                  num_microbatches: int, deferred: int | None) -> tuple[int, ...]:
    return memory_codes(replica_actions(name, stage, stage_replicas, replica, num_microbatches, deferred))


def _stage_peak(costs: PipelineCosts) -> Callable[[int, str, int | None], float]:
    """peak(s, schedule, deferred W's): stage s's peak memory on `costs` (static + what its
    microbatches hold, action by action: `rank_memory_peak`), its busiest replica."""
    m, S = costs.num_microbatches, costs.num_stages
    replicas = tuple(len(devs) for devs in costs.stage_devices)
    act = costs.activation_bytes_per_microbatch
    hold = costs.weight_hold_bytes_per_microbatch or act
    transient = costs.transient_bytes or (0.0,) * S
    loss_tr = costs.loss_transient_bytes or (0.0,) * S

    def peak(s: int, name: str, d: int | None) -> float:
        return costs.static_memory_bytes[s] + max(
            held_peak(_memory_codes(name, s, replicas, k, m, d), act[s], hold[s], transient[s],
                       loss_tr[s])
            for k in _replica_kinds(m, replicas[s]))
    return peak


def zb_h1_memory_deferrals(costs: PipelineCosts) -> list[int]:
    """Per stage, the W's a ZB-H1 replica defers: `zb_h1_deferred_w`, lowered until the stage's
    peak memory (static + what its microbatches hold, action by action: `rank_memory_peak`) is
    within the 1F1B peak of the busiest stage on the same costs, and within the stage's own
    memory limit (on devices of several sizes the busiest stage may sit on a larger one: a
    stage on a 2 GB device deferred up to a 2.5 GB peak set by a stage on a 16 GB device, and
    fitted only where a third stage recomputed to lower that peak). `FUSED` (B and W as one
    backward) where that leaves 0: on stage 0, whose B sends nothing (the same time, one
    action fewer), on a stage that deferring nothing would still exceed that cap by one
    microbatch's W gradients (fused, it holds its own 1F1B peak), and on a stage holding a layer
    whose backward runs only whole (`costs.whole_backward`)."""
    m, S = costs.num_microbatches, costs.num_stages
    replicas = tuple(len(devs) for devs in costs.stage_devices)
    peak = _stage_peak(costs)
    busiest = max(peak(s, "1f1b", None) for s in range(S))
    out = []
    for s in range(S):
        if costs.whole_backward is not None and costs.whole_backward[s]:
            out.append(FUSED)  # (no deferral to price)
            continue
        cap = min(busiest, costs.memory_limit_bytes[s]) * (1 + 1e-12)
        d = max(zb_h1_deferred_w(m, replicas, s, k) for k in _replica_kinds(m, replicas[s]))
        if d > 0 and peak(s, "zb-h1", d) > cap:
            lo, hi = 0, d  # deferring more never holds less: bisect for the most that fits
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if peak(s, "zb-h1", mid) > cap:
                    hi = mid
                else:
                    lo = mid
            d = lo
        if d == 0 and (s == 0 or peak(s, "zb-h1", 0) > cap):
            d = FUSED
        out.append(d)
    return out


def zb_h1_own_peaks(costs: PipelineCosts) -> list[float]:
    """Per stage, what its own costs make it hold under ZB-H1 whatever the other stages do: its
    1F1B peak (the least, fused or deferring nothing; the cap of every stage's deferrals is
    the largest of these, or the stage's own memory limit if less). A stage above its memory
    limit here must recompute; once every such stage has, the others fit
    (`planner.search.space.Evaluator`)."""
    peak = _stage_peak(costs)
    return [peak(s, "1f1b", None) for s in range(costs.num_stages)]


def generate(name: str, stage_devices: Sequence[Sequence[int]], num_microbatches: int,
             deferred: Sequence[int] | None = None) -> dict[int, list[Action]]:
    """Per global rank, its actions; `stage_devices[s][k]` is the rank of replica k of stage s;
    ZB-H1 defers `deferred[s]` W's on stage s (None: `zb_h1_deferred_w`; `FUSED`: none, one
    backward)."""
    if name not in SCHEDULES:
        raise PipeplanError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    replicas = [len(devs) for devs in stage_devices]
    _check_deferred(deferred, len(stage_devices))
    out: dict[int, list[Action]] = {}
    for s, devs in enumerate(stage_devices):
        for k, rank in enumerate(devs):
            out[rank] = replica_actions(name, s, replicas, k, num_microbatches,
                                        deferred[s] if deferred is not None else None)
    return out


def _check_deferred(deferred: Sequence[int] | None, num_stages: int) -> None:
    if deferred is not None and (len(deferred) != num_stages or any(d < FUSED for d in deferred)):
        raise PipeplanError(f"schedule generator: deferred_w must give one count >= 0 per stage "
                            f"({num_stages}), not {list(deferred)}; make the plan again")


def generator_deferred(generator: ScheduleGenerator, num_stages: int | None = None) -> list[int] | None:
    """A stored generator's per-stage ZB-H1 deferral counts, if it has them, `FUSED` on the
    stages its `fused_backward` lists; checked against the plan's `num_stages`. A hand-edited
    file whose counts are not what `plan_schedule_fields` writes is refused, not ignored."""
    d, fused = generator.params.get("deferred_w"), generator.params.get("fused_backward")
    again = "; make the plan again"
    if generator.name != "zb-h1":
        if d is not None or fused is not None:
            raise PipeplanError(f"schedule generator: deferred_w and fused_backward are ZB-H1's, "
                                f"not {generator.name}'s{again}")
        return None
    if d is None:
        if fused is not None:
            raise PipeplanError(f"schedule generator: fused_backward needs deferred_w (a count of "
                                f"deferred W's per stage){again}")
        return None
    if not isinstance(d, list) or any(x < 0 for x in d):
        raise PipeplanError(f"schedule generator: deferred_w must give one count >= 0 per stage, "
                            f"not {d}{again}")
    if num_stages is not None and len(d) != num_stages:
        raise PipeplanError(f"schedule generator: deferred_w has {len(d)} counts {d} but the plan "
                            f"has {num_stages} stages{again}")
    fused = [] if fused is None else fused
    if not isinstance(fused, list) or any(not 0 <= s < len(d) for s in fused):
        raise PipeplanError(f"schedule generator: fused_backward lists stages {fused}, but the plan "
                            f"has {len(d)} (a list of stage indices 0..{len(d) - 1}){again}")
    if any(d[s] != 0 for s in fused):
        raise PipeplanError(f"schedule generator: a stage in fused_backward {fused} defers no W "
                            f"(its deferred_w count is 0), not {d}{again}")
    return [FUSED if s in fused else x for s, x in enumerate(d)]


def generate_rank(name: str, stage_devices: Sequence[Sequence[int]], num_microbatches: int,
                  rank: int, deferred: Sequence[int] | None = None) -> list[Action]:
    """One rank's actions without generating the others' (what a runtime rank needs)."""
    _check_deferred(deferred, len(stage_devices))
    for s, devs in enumerate(stage_devices):
        if rank in devs:
            return replica_actions(name, s, [len(d) for d in stage_devices],
                                   list(devs).index(rank), num_microbatches,
                                   deferred[s] if deferred is not None else None)
    raise PipeplanError(f"rank {rank} is not in the plan (it has {sum(map(len, stage_devices))} ranks)")


def tp_leaders(stage_devices: Sequence[Sequence[int]], tps: Sequence[int] | None
               ) -> list[list[int]]:
    """Per stage, the first rank of each replica: a stage with tensor-parallel degree t lists
    replicas x t ranks, replica-major, and the t ranks of a replica run the same actions."""
    if not tps:
        return [list(d) for d in stage_devices]
    return [list(d)[::t] for d, t in zip(stage_devices, tps, strict=True)]


def with_tp_ranks(lists: dict[int, list[Action]], stage_devices: Sequence[Sequence[int]],
                  tps: Sequence[int] | None) -> dict[int, list[Action]]:
    """Give every tensor-parallel rank its replica's actions (`lists` keyed by replica leaders)."""
    if not tps or all(t == 1 for t in tps):
        return lists
    out = dict(lists)
    for devs, t in zip(stage_devices, tps, strict=True):
        for k, rank in enumerate(devs):
            out[rank] = lists[devs[(k // t) * t]]
    return out


def total_actions(stage_devices: Sequence[Sequence[int]], num_microbatches: int) -> int:
    return 2 * num_microbatches * len(stage_devices)


def total_actions_for(name: str, stage_devices: Sequence[Sequence[int]], num_microbatches: int) -> int:
    return (3 if name == "zb-h1" else 2) * num_microbatches * len(stage_devices)


def plan_schedule_fields(name: str, stage_devices: Sequence[Sequence[int]], num_microbatches: int,
                         limit: int = EXPLICIT_LIMIT_ACTIONS, tps: Sequence[int] | None = None,
                         deferred: Sequence[int] | None = None
                         ) -> tuple[dict[str, list[str]] | None, ScheduleGenerator]:
    """What a plan stores: explicit per-rank action strings when small (else None) and always
    the generator that reproduces them. `stage_devices` lists every rank of a stage; with
    tensor-parallel degrees `tps` the ranks of one replica get the same list; ZB-H1's
    per-stage `deferred` counts (see `generate`) go into the generator's params: `deferred_w`
    (0 where fused) and the fused stages in `fused_backward`."""
    params: dict[str, int | list[int]] = {"num_microbatches": num_microbatches}
    if deferred is not None and name == "zb-h1":
        params["deferred_w"] = [max(d, 0) for d in deferred]
        params["fused_backward"] = [s for s, d in enumerate(deferred) if d == FUSED]
    else:
        deferred = None
    generator = ScheduleGenerator(name=name, params=params)  # type: ignore[arg-type]
    if total_actions_for(name, stage_devices, num_microbatches) > limit:
        return None, generator
    lists = with_tp_ranks(generate(name, tp_leaders(stage_devices, tps), num_microbatches, deferred),
                          stage_devices, tps)
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
    for st in plan.stages:  # a tensor-parallel rank runs its replica's actions
        if rank in st.devices:
            rank = st.devices[(st.devices.index(rank) // st.tp) * st.tp]
    return generate_rank(plan.generator.name, [s.replica_ranks() for s in plan.stages], m, rank,
                         generator_deferred(plan.generator, len(plan.stages)))


def plan_actions(plan: Plan) -> dict[int, list[Action]]:
    """Every rank's actions of a plan."""
    if plan.rank_actions is not None:
        return {int(r): parse_actions(a) for r, a in plan.rank_actions.items()}
    assert plan.generator is not None
    m = plan.generator.params.get("num_microbatches", plan.num_microbatches)
    assert isinstance(m, int)
    return with_tp_ranks(generate(plan.generator.name, [s.replica_ranks() for s in plan.stages], m,
                                  generator_deferred(plan.generator, len(plan.stages))),
                         [s.devices for s in plan.stages], [s.tp for s in plan.stages])
