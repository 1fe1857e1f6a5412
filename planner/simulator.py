"""Discrete-event simulation of a schedule with the cost model's durations.

Each rank runs its actions in order. An action starts when its rank is free and its inputs have
arrived: a forward waits for the forwards of the same microbatch on the stages that send to it
(producer's end + transfer); a backward for its own forward and for the backwards of the stages
it sent to (their end + transfer of the gradient). Transfers delay, they do not occupy a rank.
Once every replica of a stage has finished its last backward, all of them all-reduce; then each
device runs its optimizer step (`PipelineCosts.optimizer_ms`, where measured).

Three kinds: F, B and W. On a rank whose actions include W (zero-bubble schedules), B is the
input gradient (`PipelineCosts.bwd_split`) and W the weight gradient, which waits only for its
own B (earlier on the same rank) and sends nothing; without W, B is the full backward. Memory
per rank: parameters and optimizer state, plus what each microbatch keeps from its forward until
its backward is done (B, or W where split: after B it keeps `weight_hold_bytes_per_microbatch`),
plus, while a backward (B or W) runs, `transient_bytes` (a recomputed block's activations),
and while a B runs `loss_transient_bytes` (the loss's backward working memory, last stage):
`planner.cost.rank_memory_peak`.

The simulation is dependency-driven (each action is timed once its inputs are timed), so it
costs O(actions x stage pairs) and handles plans with thousands of ranks quickly.

The search scores thousands of candidates that share a schedule's shape (the replicas of each
stage, the microbatches, which stages send to which) and differ only in durations and bytes.
`simulate_generated` keeps, per shape, the actions in an order where every action comes after
those it waits for (`_Shape`, made once by the same dependency walk); a candidate is then timed
by one pass over that order, with the same additions and comparisons as `simulate_costs`, so
the same times and memory to the bit (tests/planner/test_search_evaluation.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

from planner.actions import Action
from planner.cost import PipelineCosts, Send, held_peak, memory_codes, rank_memory_peak
from planner.formats import Plan
from planner.schedules import generate, memory_representatives

_mb, _kind = attrgetter("mb"), attrgetter("kind")


class Event(NamedTuple):
    """One timed piece of work on one rank; the runtime records the same from real runs."""

    rank: int
    name: str  # "1F3", or "allreduce 1"
    kind: str  # "F" | "B" | "W" | "allreduce" | "optimizer"
    stage: int
    mb: int  # -1 for allreduce
    start_ms: float
    end_ms: float


@dataclass
class Simulation:
    events: list[Event]
    iteration_ms: float  # makespan, all-reduces included
    busy_ms: dict[int, float]  # forward + backward (B and W) + optimizer step, per rank
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
    for s, devs in enumerate(costs.stage_devices):  # then each device's optimizer step
        opt = costs.optimizer_ms[s] if costs.optimizer_ms is not None else 0.0
        if opt <= 0:
            continue
        for d in devs:
            if d not in free:
                continue
            if record:
                events.append(Event(d, f"optimizer {s}", "optimizer", s, -1, free[d], free[d] + opt))
            free[d] += opt
            busy[d] += opt
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
        bubble_fraction=max(0.0, sum(idle.values()) / total) if total > 0 else 0.0,  # (no -1e-17)
        peak_inflight=peak, peak_memory_bytes=memory, stage_of_rank=stage_of_rank,
    )


class _Shape(NamedTuple):
    """A generated schedule's dependency structure, without durations or bytes. Slots are the
    (stage, replica) pairs in `generate`'s order (stage-major); `items` holds every action in
    an order where each comes after the actions it waits for: (slot, duration index 4 s +
    {F 0, full B 1, split B 2, W 3}, ((item it waits for, index of its send in `pairs`), ...))."""

    slots: tuple[tuple[int, int], ...]
    items: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    pairs: tuple[tuple[int, int], ...]
    memory_slot: tuple[int, ...]  # per slot, the slot whose actions hold the same memory
    # per slot that is its own memory_slot: its peak in flight and its actions' `memory_codes`
    memory: dict[int, tuple[int, tuple[int, ...]]]


SHAPES_KEPT = 2048  # shapes of at most SHAPE_ACTIONS actions each (tens of MB at most)
SHAPE_ACTIONS = 8192
_shapes: OrderedDict[tuple, _Shape] = OrderedDict()
# shapes seen once: a shape costs about 1.5 plain simulations to make, and a third of the
# search's shapes come only once, so a shape is made the second time it comes
_seen: OrderedDict[tuple, None] = OrderedDict()


def _shape(name: str, replicas: tuple[int, ...], m: int, deferred: tuple[int, ...] | None,
           pairs: tuple[tuple[int, int], ...]) -> _Shape | None:
    """The walk `simulate_costs` does, once per shape, recording the order instead of times;
    None where the schedule cannot run (`simulate_costs` says why)."""
    S = len(replicas)
    fake = [list(range(sum(replicas[:s]), sum(replicas[:s + 1]))) for s in range(S)]
    schedule = generate(name, fake, m, list(deferred) if deferred is not None else None)
    slots = tuple((s, k) for s in range(S) for k in range(replicas[s]))
    # what each kind of action waits for: (key of that action less the microbatch, index of
    # the send it waits through or -1 for an earlier action of its own rank); key = (stage * 3
    # + kind) * m + mb with kind F 0, B 1, W 2
    need: list[list[tuple[int, int]]] = []
    for s in range(S):
        need += [[], [(s * 3 * m, -1)], [((s * 3 + 1) * m, -1)]]
    for q, (s, t) in enumerate(pairs):
        need[3 * t].append((s * 3 * m, q))
        need[3 * s + 1].append(((t * 3 + 1) * m, q))
    kinds = {"F": 0, "B": 1, "W": 2}
    index: dict[int, int] = {}  # key -> item
    items: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
    waiters: dict[int, list[int]] = {}
    pos = [0] * len(slots)
    split = [any(a.kind == "W" for a in schedule[r]) for r in range(len(slots))]
    stack = list(range(len(slots)))
    while stack:
        r = stack.pop()
        acts = schedule[r]
        i = pos[r]
        b_dur = 2 if split[r] else 1
        while i < len(acts):
            a = acts[i]
            s, j, kind = a.stage, a.mb, kinds[a.kind]
            waits = need[3 * s + kind]
            missing = -1
            for k0, _ in waits:
                if k0 + j not in index:
                    missing = k0 + j
                    break
            if missing >= 0:
                waiters.setdefault(missing, []).append(r)
                break
            key = (s * 3 + kind) * m + j
            index[key] = len(items)
            items.append((r, 4 * s + (0 if kind == 0 else b_dur if kind == 1 else 3),
                          tuple([(index[k0 + j], q) for k0, q in waits if q >= 0])))
            i += 1
            woken = waiters.pop(key, None)
            if woken:
                stack.extend(woken)
        pos[r] = i
    if any(pos[r] < len(schedule[r]) for r in range(len(slots))):
        return None
    reps = memory_representatives(fake, m)
    same = tuple(reps[r] for r in range(len(slots)))
    memory = {}
    for r in set(same):
        codes = memory_codes(schedule[r])
        memory[r] = (_inflight_peak(codes), codes)
    return _Shape(slots, tuple(items), pairs, same, memory)


def _inflight_peak(codes: tuple[int, ...]) -> int:
    inflight = peak = 0
    for c in codes:
        if c == 0:
            inflight += 1
            peak = max(peak, inflight)
        elif c != 1:
            inflight -= 1
    return peak


def simulate_generated(costs: PipelineCosts, name: str,
                       deferred: Sequence[int] | None = None) -> Simulation:
    """`simulate_costs(costs, generate(name, costs.stage_devices, m, deferred), record=False,
    same_memory=memory_representatives(...))`, to the bit, without events: the search's
    scoring. The schedule's shape is kept between calls (`_Shape`)."""
    replicas = tuple(len(d) for d in costs.stage_devices)
    m = costs.num_microbatches
    pairs = tuple(costs.sends)
    key = (name, replicas, m, tuple(deferred) if deferred is not None else None, pairs)
    shape = _shapes.get(key)
    if shape is None:
        if key not in _seen:  # the first time: simulated as it comes (also where it cannot run)
            _seen[key] = None
            if len(_seen) > 4 * SHAPES_KEPT:
                _seen.popitem(last=False)
            return simulate_costs(costs, generate(name, costs.stage_devices, m, deferred), False,
                                  memory_representatives(costs.stage_devices, m))
        shape = _shape(name, replicas, m, key[3], pairs)
        if shape is None:  # the validator names what blocks it
            return simulate_costs(costs, generate(name, costs.stage_devices, m, deferred), False)
        if len(shape.items) <= SHAPE_ACTIONS:
            _shapes[key] = shape
            if len(_shapes) > SHAPES_KEPT:
                _shapes.popitem(last=False)
    else:
        _shapes.move_to_end(key)
    S = len(replicas)
    durs: list[float] = []
    for s in range(S):
        b, w = costs.bwd_split(s)
        durs += (costs.fwd_ms[s], costs.bwd_ms[s], b, w)
    ms = [costs.sends[p].ms for p in pairs]
    n_slots = len(shape.slots)
    end = [0.0] * len(shape.items)
    free = [0.0] * n_slots
    busy = [0.0] * n_slots
    i = 0
    for r, d, deps in shape.items:
        ready = free[r]
        for e_i, q in deps:
            e = end[e_i] + ms[q]
            if e > ready:
                ready = e
        dur = durs[d]
        t = ready + dur
        end[i] = t
        free[r] = t
        busy[r] += dur
        i += 1
    ranks = [costs.stage_devices[s][k] for s, k in shape.slots]
    first = [0] * S  # first slot of each stage
    for x in range(n_slots - 1, -1, -1):
        first[shape.slots[x][0]] = x
    comm = [0.0] * n_slots
    for s in range(S):
        ar = costs.allreduce_ms[s]
        r_s = replicas[s]
        if r_s <= 1 or ar <= 0:
            continue
        lo = first[s]
        start = max(free[lo:lo + r_s])
        for x in range(lo, lo + r_s):
            free[x] = start + ar
            comm[x] += ar
    if costs.optimizer_ms is not None:  # then each device's optimizer step
        for x in range(n_slots):
            opt = costs.optimizer_ms[shape.slots[x][0]]
            if opt > 0:
                free[x] += opt
                busy[x] += opt
    makespan = max(free, default=0.0)
    idle = [makespan - busy[x] - comm[x] for x in range(n_slots)]
    total = makespan * n_slots
    act = costs.activation_bytes_per_microbatch
    hold = costs.weight_hold_bytes_per_microbatch or act
    transient = costs.transient_bytes or (0.0,) * S
    loss_tr = costs.loss_transient_bytes or (0.0,) * S
    held: dict[int, tuple[int, float]] = {}
    for rep, (inflight, codes) in shape.memory.items():
        s = shape.slots[rep][0]
        held[rep] = (inflight, held_peak(codes, act[s], hold[s], transient[s], loss_tr[s]))
    return Simulation(
        events=[], iteration_ms=makespan, busy_ms=dict(zip(ranks, busy, strict=True)),
        comm_ms=dict(zip(ranks, comm, strict=True)), idle_ms=dict(zip(ranks, idle, strict=True)),
        bubble_fraction=max(0.0, sum(idle) / total) if total > 0 else 0.0,
        peak_inflight={ranks[x]: held[shape.memory_slot[x]][0] for x in range(n_slots)},
        peak_memory_bytes={ranks[x]: costs.static_memory_bytes[shape.slots[x][0]]
                           + held[shape.memory_slot[x]][1] for x in range(n_slots)},
        stage_of_rank={ranks[x]: shape.slots[x][0] for x in range(n_slots)},
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
        # what the framework reserves on each device (planner.solve.make_plan) is held from
        # the start, like the parameters
        static_memory_bytes=tuple(extra(st.predicted, "static_memory_bytes")
                                  + extra(st.predicted, "reserved_memory_bytes") for st in stages),
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
        loss_transient_bytes=tuple(extra(st.predicted, "loss_transient_bytes") for st in stages),
        optimizer_ms=tuple(extra(st.predicted, "optimizer_ms") for st in stages)
        if any(extra(st.predicted, "optimizer_ms") for st in stages) else None,
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
