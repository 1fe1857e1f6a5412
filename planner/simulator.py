"""Discrete-event simulation of a schedule with the cost model's durations.

Each rank runs its actions in order. An action starts when its rank is free and its inputs have
arrived: a forward waits for the forwards of the same microbatch on the stages that send to it
(producer's end + transfer); a backward for its own forward and for the backwards of the stages
it sent to (their end + transfer of the gradient). Transfers delay, they do not occupy a rank.
Once every replica of a stage has finished its last backward, all of them all-reduce.

Three kinds: F, B and W. On a rank whose actions include W (zero-bubble schedules), B is the
input gradient (`PipelineCosts.bwd_split`) and W the weight gradient, which waits only for its
own B (earlier on the same rank) and sends nothing; without W, B is the full backward. Memory
per rank: parameters and optimizer state, plus what each microbatch keeps from its forward until
its backward is done (B, or W where split: after B it keeps `weight_hold_bytes_per_microbatch`),
plus, while a backward (B or W) runs, `transient_bytes` (a recomputed block's activations):
`planner.cost.rank_memory_peak`.

The simulation is dependency-driven (each action is timed once its inputs are timed), so it
costs O(actions x stage pairs) and handles plans with thousands of ranks quickly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

from planner.actions import Action
from planner.cost import PipelineCosts, Send, rank_memory_peak
from planner.formats import Plan

_mb, _kind = attrgetter("mb"), attrgetter("kind")


class Event(NamedTuple):
    """One timed piece of work on one rank; the runtime records the same from real runs."""

    rank: int
    name: str  # "1F3", or "allreduce 1"
    kind: str  # "F" | "B" | "W" | "allreduce"
    stage: int
    mb: int  # -1 for allreduce
    start_ms: float
    end_ms: float


@dataclass
class Simulation:
    events: list[Event]
    iteration_ms: float  # makespan, all-reduces included
    busy_ms: dict[int, float]  # forward + backward per rank
    comm_ms: dict[int, float]  # all-reduce per rank
    idle_ms: dict[int, float]  # makespan - busy - comm
    bubble_fraction: float  # idle / (ranks x makespan)
    peak_inflight: dict[int, int]  # per rank
    peak_memory_bytes: dict[int, float]  # per rank
    stage_of_rank: dict[int, int] = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.busy_ms)


def simulate_costs(costs: PipelineCosts, schedule: Mapping[int, Sequence[Action]],
                   record: bool = True, same_memory: Mapping[int, int] | None = None) -> Simulation:
    """Simulate `schedule` (rank -> actions) with `costs`; a schedule that cannot run raises the
    validator's ScheduleError. Without `record`, `events` stays empty (the search needs only
    the times and the memory: a third less work). `same_memory`: per rank, a rank whose
    actions hold the same memory (`planner.schedules.memory_representatives`), counted once."""
    S, m = costs.num_stages, costs.num_microbatches
    stage_of_rank = {r: s for s, devs in enumerate(costs.stage_devices) for r in devs}
    producers: list[list[tuple[int, float]]] = [[] for _ in range(S)]
    consumers: list[list[tuple[int, float]]] = [[] for _ in range(S)]
    for (s, t), send in costs.sends.items():
        producers[t].append((s, send.ms))
        consumers[s].append((t, send.ms))
    M = max(m, 1 + max(map(_mb, chain.from_iterable(schedule.values())), default=0))
    # keys of the actions each one waits for, less the microbatch: (stage * 3 + kind) * M
    wait_f = [[(p * 3 * M, ms) for p, ms in producers[s]] for s in range(S)]
    wait_b = [[((c * 3 + 1) * M, ms) for c, ms in consumers[s]] for s in range(S)]

    # end time per action, keyed (stage * 3 + kind) * M + mb with kind F 0, B 1, W 2
    end: dict[int, float] = {}
    get = end.get
    waiters: dict[int, list[int]] = {}
    pos = {r: 0 for r in schedule}
    free = {r: 0.0 for r in schedule}
    split = {r: "W" in map(_kind, acts) for r, acts in schedule.items()}
    bw_split = [costs.bwd_split(s) for s in range(S)]
    b_only = [b for b, _ in bw_split]  # a B where the rank's backward is split
    busy = {r: 0.0 for r in schedule}
    events: list[Event] = []
    fwd, bwd = costs.fwd_ms, costs.bwd_ms
    stack = list(schedule)
    while stack:
        r = stack.pop()
        acts = schedule[r]
        n = len(acts)
        i = pos[r]
        t_free = free[r]
        spent = busy[r]
        bdur = b_only if split[r] else bwd
        while i < n:
            a = acts[i]
            s, j, kind = a.stage, a.mb, a.kind
            ready = t_free
            missing = -1
            if kind == "F":
                for base, ms in wait_f[s]:
                    e = get(base + j)
                    if e is None:
                        missing = base + j
                        break
                    if e + ms > ready:
                        ready = e + ms
                dur = fwd[s]
                key = s * 3 * M + j
            elif kind == "B":
                e = get(s * 3 * M + j)
                if e is None:
                    missing = s * 3 * M + j
                else:
                    for base, ms in wait_b[s]:
                        e = get(base + j)
                        if e is None:
                            missing = base + j
                            break
                        if e + ms > ready:
                            ready = e + ms
                dur = bdur[s]
                key = (s * 3 + 1) * M + j
            else:
                if (s * 3 + 1) * M + j not in end:
                    missing = (s * 3 + 1) * M + j
                dur = bw_split[s][1]
                key = (s * 3 + 2) * M + j
            if missing >= 0:
                waiters.setdefault(missing, []).append(r)
                break
            t_free = ready + dur
            end[key] = t_free
            spent += dur
            if record:
                events.append(Event(r, str(a), kind, s, j, ready, t_free))
            i += 1
            woken = waiters.pop(key, None)
            if woken:
                stack.extend(woken)
        pos[r] = i
        free[r] = t_free
        busy[r] = spent

    if any(pos[r] < len(acts) for r, acts in schedule.items()):
        from planner.validate import validate

        validate(schedule, num_stages=S, deps=costs.sends.keys())
        raise AssertionError("simulation stuck but the validator found no problem")  # pragma: no cover

    tp_f, tp_b = getattr(costs, "tp_comm_fwd_ms", ()), getattr(costs, "tp_comm_bwd_ms", ())
    if tp_f and record:  # a TP stage's all-reduces, at the end of each forward/backward (inside it)
        for e in list(events):
            c = tp_f[e.stage] if e.kind == "F" else tp_b[e.stage] if e.kind == "B" else 0.0
            if c > 0:
                events.append(Event(e.rank, f"TP {e.name}", "tp", e.stage, e.mb, e.end_ms - c, e.end_ms))
    comm = {r: 0.0 for r in schedule}
    for s, devs in enumerate(costs.stage_devices):
        ar = costs.allreduce_ms[s]
        if len(devs) <= 1 or ar <= 0:
            continue
        start = max(free.get(d, 0.0) for d in devs)
        for d in devs:
            if record:
                events.append(Event(d, f"allreduce {s}", "allreduce", s, -1, start, start + ar))
            free[d] = start + ar
            comm[d] += ar
    makespan = max(free.values(), default=0.0)
    idle = {r: makespan - busy[r] - comm[r] for r in schedule}
    total = makespan * len(schedule)
    held: dict[int, tuple[int, float]] = {}
    for r in schedule:
        rep = same_memory.get(r, r) if same_memory is not None else r
        if rep not in held:
            held[rep] = rank_memory_peak(schedule[rep], costs)
        held[r] = held[rep]
    peak = {r: held[r][0] for r in schedule}
    memory = {r: costs.static_memory_bytes[stage_of_rank[r]] + held[r][1]
              for r in schedule if r in stage_of_rank}
    return Simulation(
        events=events, iteration_ms=makespan, busy_ms=busy, comm_ms=comm, idle_ms=idle,
        bubble_fraction=sum(idle.values()) / total if total > 0 else 0.0,
        peak_inflight=peak, peak_memory_bytes=memory, stage_of_rank=stage_of_rank,
    )


def costs_from_plan(plan: Plan) -> PipelineCosts:
    """The costs a plan.json carries (written by build_plan in each stage's `predicted`)."""
    stages = plan.stages
    sends: dict[tuple[int, int], Send] = {}
    for st in stages:
        for snd in getattr(st.predicted, "sends", None) or []:
            sends[(st.index, int(snd["to"]))] = Send(float(snd["bytes"]), float(snd["ms"]))
    for s in range(1, len(stages)):
        sends.setdefault((s - 1, s), Send(0.0, 0.0))

    def extra(st: object, name: str) -> float:
        return float(getattr(st, name, None) or 0.0)

    return PipelineCosts(  # a tensor-parallel replica is simulated as its first rank
        stage_devices=tuple(tuple(st.devices[::getattr(st, "tp", 1)]) for st in stages),
        num_microbatches=plan.num_microbatches,
        fwd_ms=tuple(st.predicted.fwd_ms for st in stages),
        bwd_ms=tuple(st.predicted.bwd_ms for st in stages),
        allreduce_ms=tuple(st.predicted.allreduce_ms for st in stages),
        static_memory_bytes=tuple(extra(st.predicted, "static_memory_bytes") for st in stages),
        activation_bytes_per_microbatch=tuple(
            extra(st.predicted, "activation_bytes_per_microbatch") for st in stages),
        memory_limit_bytes=tuple(float(st.predicted.memory_limit_bytes) for st in stages),
        sends=sends,
        bwd_weight_ms=tuple(
            extra(st.predicted, "bwd_weight_ms") if getattr(st.predicted, "bwd_weight_ms", None) is not None
            else 0.5 * st.predicted.bwd_ms for st in stages),
        bwd_input_ms=tuple(
            extra(st.predicted, "bwd_input_ms") if getattr(st.predicted, "bwd_input_ms", None) is not None
            else st.predicted.bwd_ms - (extra(st.predicted, "bwd_weight_ms")
                                        if getattr(st.predicted, "bwd_weight_ms", None) is not None
                                        else 0.5 * st.predicted.bwd_ms) for st in stages),
        weight_hold_bytes_per_microbatch=tuple(
            extra(st.predicted, "weight_hold_bytes_per_microbatch")
            if getattr(st.predicted, "weight_hold_bytes_per_microbatch", None) is not None
            else extra(st.predicted, "activation_bytes_per_microbatch") for st in stages),
        transient_bytes=tuple(extra(st.predicted, "transient_bytes") for st in stages),
        recompute=tuple(bool(getattr(st, "recompute", False)) for st in stages),
        **({"tp": tuple(getattr(st, "tp", 1) for st in stages),
            "tp_comm_fwd_ms": tuple(extra(st.predicted, "tp_comm_fwd_ms") for st in stages),
            "tp_comm_bwd_ms": tuple(extra(st.predicted, "tp_comm_bwd_ms") for st in stages)}
           if any(getattr(st, "tp", 1) > 1 for st in stages) else {}),
    )


def simulate(plan_or_costs: Plan | PipelineCosts,
             schedule: Mapping[int, Sequence[Action | str]] | None = None) -> Simulation:
    """Simulate a plan (its own costs and schedule) or costs with a given schedule (actions or
    their strings, "1F3")."""
    if schedule is not None:
        schedule = {r: [a if isinstance(a, Action) else Action.parse(a) for a in acts]
                    for r, acts in schedule.items()}
    if isinstance(plan_or_costs, Plan):
        from planner.schedules import plan_actions

        costs = costs_from_plan(plan_or_costs)
        if schedule is None:
            tracked = {r for devs in costs.stage_devices for r in devs}
            schedule = {r: a for r, a in plan_actions(plan_or_costs).items() if r in tracked}
        return simulate_costs(costs, schedule)  # type: ignore[arg-type]
    if schedule is None:
        raise ValueError("simulate(costs) needs a schedule (planner.schedules.generate)")
    return simulate_costs(plan_or_costs, schedule)  # type: ignore[arg-type]
