"""A proof by enumeration, where the bound's DP leaves few plans: every split, replica vector
and TP degrees that meet the DP's conditions at a time T (`bound.StageEdges`), each simulated
at every placement.

A plan whose simulated time is at most T meets every condition of the DP at T (that is what
makes the DP a bound), so it is one of the paths enumerated here. Simulating them all gives
the best plan of time at most T, if there is one, and otherwise proves that none exists: the
optimum is then at least T. With T the best plan found, the optimum itself comes out, with a
gap of 0; with T 1 % below it, a proof of the 1 %. This works where the conditions are tight
enough that few plans meet them: on small models, and where memory leaves few splits (the
U-Net example on 16 devices at 1 GB/s with tight memory: 14 paths at the best plan's time,
one of them 3.7 % faster than the plan the search had found).

The best simulated time of a structure over its placements and recomputation is exact only
where the placements are all tried: on clusters whose devices are interchangeable (one node,
or nodes of one device each, all alike) one placement stands for all; elsewhere every node
placement (`space.node_placements`) up to a limit, and a structure with more is not proven.
Under 1F1B and GPipe a structure is first simulated once on `relaxed_cluster` (every device
the fastest and largest, every link the fastest): no placement is faster than that, so only
structures faster there than the best plan found (and than T) are placed every way.
Recomputation: `Evaluator.evaluate_placed` recomputes exactly the stages that overflow, the
best choice for a placed structure under 1F1B and GPipe, where a stage's memory is its own.
Not under ZB-H1: how many W's a stage may defer depends on the busiest stage's 1F1B peak and
on its own memory, so recomputing a stage that fits can let it or another stage defer more,
and recomputing one stage can make another fit. There every set of the stages that may
recompute is simulated at every placement (`recompute_sets`: 2^S per placement, on small
instances; where the work does not cover them, nothing is proven). With `--powers-of-two`
the DP's plans become plans of power-of-two replica counts (`powers_of_two_plans`: the DP
lists counts up to m, and its count m stands for the counts above m too); until 2026-12-07
it proved nothing there, and on 25 instances made from real profiles with the option, 11
kept gaps of 1-51 % at plans that were the optimum (an outside exhaustive check).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from planner.cost import link_latency_us
from planner.formats import Cluster
from planner.partition import Candidate
from planner.search.bound import Conditions, TooManyStages, allowed_stages, tighten_step_work
from planner.search.space import (
    Evaluator,
    Score,
    Structure,
    candidate_of,
    every_node_placement,
)

EDGE_WORK = 2  # per stage recorded: 4-6 us each, about 2 units of a DP's work (resnet18, squeezenet)
PLACEMENT_LIMIT = 5000  # node placements of one replica vector, at most; one with more is not proven
PLACEMENT_WORK = 2  # per node placement enumerated (duplicates included)

Plan = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # bounds, replicas, TP degrees


def allowed_plans(c: Conditions, T: float, max_plans: int, max_stages: int
                  ) -> tuple[list[Plan] | None, int]:
    """Every (split, replicas, TP degrees) meeting the DP's conditions at T, in a fixed order
    (None if more than `max_plans`, or the DP allows more than `max_stages` stages), and the
    work spent."""
    work = tighten_step_work(c)
    try:
        edges = allowed_stages(c, T, max_stages)
    except TooManyStages:
        return None, work + EDGE_WORK * max_stages
    work += EDGE_WORK * edges.count
    out_of = {k: sorted(v) for k, v in edges.by_state.items()}
    L = c.L
    count: dict[tuple[int, int], int] = {(L, 0): 1}  # paths from each state to the end
    for i, d in sorted(out_of, reverse=True):  # a stage ends after it starts: later layers first
        count[(i, d)] = sum(count.get((j, d - r * t), 0) for j, r, t in out_of[(i, d)])
    total = sum(count.get((0, d), 0) for d in range(c.D + 1))
    if total > max_plans:
        return None, work
    plans: list[Plan] = []

    def walk(i: int, d: int, bounds: list[int], reps: list[int], tps: list[int]) -> None:
        if i == L:
            plans.append((tuple(bounds), tuple(reps), tuple(tps)))
            return
        for j, r, t in out_of.get((i, d), ()):
            if count.get((j, d - r * t), 0):
                walk(j, d - r * t, bounds + [j], reps + [r], tps + [t])

    for d in range(c.D + 1):
        if count.get((0, d)):
            walk(0, d, [0], [], [])
    return sorted(plans), work


def powers_of_two_plans(plans: list[Plan], m: int, D: int) -> list[Plan]:
    """The DP's plans (`allowed_plans`) as plans whose replica counts are powers of two. The
    DP lists every count up to m, each priced as itself, so a power of two up to m is its own
    plan. A count above m runs one microbatch a replica, as m does: its stage is m's with more
    devices and a larger all-reduce, and the stages before it keep as many microbatches in
    flight (at most their own, reached either way), so the DP's count m stands for those too,
    and where m is not a power of two it becomes the smallest one above m (one larger still
    is that plan with idle replicas more). A count that is neither has no such plan; nor a
    plan that would need more than D devices."""
    above = 1 << (m - 1).bit_length()  # the smallest power of two >= m
    out: set[Plan] = set()
    for bounds, reps, tps in plans:
        two = tuple(r if r & (r - 1) == 0 else above if r == m else 0 for r in reps)
        if 0 not in two and sum(r * t for r, t in zip(two, tps, strict=True)) <= D:
            out.add((bounds, two, tps))
    return sorted(out)


def recompute_sets(cand: Candidate, every: bool) -> list[Candidate]:
    """`cand` alone, or with `every`, `cand` with each set of its stages that may recompute
    (TP degree 1) recomputed, the empty set first (ZB-H1: the module docstring)."""
    if not every:
        return [cand]
    free = [s for s, x in enumerate(cand.stages) if x.tp == 1]
    out = []
    for mask in range(1 << len(free)):
        on = {free[k] for k in range(len(free)) if mask >> k & 1}
        out.append(Candidate(tuple(replace(x, recompute=s in on) if x.tp == 1 else x
                                   for s, x in enumerate(cand.stages)),
                             cand.microbatch_size, cand.num_microbatches, cand.solver, cand.schedule))
    return out


def interchangeable_devices(cluster: Cluster) -> bool:
    """Every placement of a structure costs the same: the devices are all alike and every
    link between two of them is the same (one node, or one device per node)."""
    specs = cluster.node_specs()
    alike = len({(s.devices, s.speed, s.device_memory_gb) for s in specs}) == 1
    return alike and (len(specs) == 1 or specs[0].devices == 1)


@dataclass
class Exhausted:
    """What `exhaust` found: the best plan of time at most T (None if none), whether every
    plan meeting the conditions was simulated at every placement (`proven`: then the optimum
    is at least min(T, best)), and the work spent."""

    best: tuple[Score, Candidate] | None
    proven: bool
    work: int

    def bound(self, T: float) -> float | None:
        if not self.proven:
            return None
        return min(T, self.best[0].objective_ms) if self.best is not None else T


def exhaust(c: Conditions, T: float, microbatch_size: int, ev: Evaluator, cluster: Cluster,
            max_work: float, deadline: float = math.inf) -> Exhausted:
    """Simulate every plan meeting `c`'s conditions at T (`allowed_plans`), each at every
    placement (one where the devices are interchangeable; under 1F1B and GPipe only those
    whose time on `relaxed_cluster` is below the best found and T), within `max_work` (the
    DP's work, its stages, the placements and the simulations together): not proven where
    that runs out, or `deadline` (`time.perf_counter()`, the wall-clock safety net) comes
    first. Where the devices are interchangeable and the work cannot cover every plan, none
    is simulated."""
    start = ev.work
    m = ev.options.global_batch // microbatch_size
    least = ev.simulation_work(m, 2, 2)  # a plan's simulation, at least
    # a DP that allows too many stages spends at most a quarter of the work recording them
    # every plan within rounding of T (the DP's sums are not the simulator's)
    plans, work = allowed_plans(c, T * (1 + 1e-9), max_plans=int(max_work // least),
                                max_stages=int(max_work // (4 * EDGE_WORK)))
    if plans is None or work > max_work:
        return Exhausted(None, False, work)
    if ev.options.powers_of_two:
        plans = powers_of_two_plans(plans, m, c.D)
    structures = [Structure(microbatch_size, b, r, 0).with_stages(b, r, t) for b, r, t in plans]
    best: tuple[Score, Candidate] | None = None

    def keep(tried: list[tuple[Score, Candidate | None]]) -> None:
        nonlocal best
        for score, cand in tried:
            if cand is not None and score.fits and (best is None or score.better_than(best[0])):
                best = (score, cand)

    # under ZB-H1 every set of recomputed stages (`recompute_sets`), 2^(TP-1 stages) each
    sets = ev.options.schedule == "zb-h1" and ev.options.allow_recompute

    def ways(st: Structure) -> int:
        return 1 << sum(1 for t in st.degrees if t == 1) if sets else 1

    if interchangeable_devices(cluster):  # one placement stands for all
        if work + sum(ev.simulation_work(m, st.num_stages, st.num_devices) * ways(st)
                      for st in structures) > max_work:
            return Exhausted(None, False, work)  # not enough work for them all: none spent on one
        for st in structures:
            score, cand = ev.scored(st)
            keep([(score, cand)])
            if sets and cand is not None:
                keep([ev.score_candidate(x, st) for x in recompute_sets(cand, True)])
            if time.perf_counter() >= deadline:
                return Exhausted(best, False, work + ev.work - start)
        return Exhausted(best, True, work + ev.work - start)
    # several placements each: under 1F1B and GPipe, a structure's time on the relaxed
    # cluster is at most its time at any placement, so only those below min(T, best) need
    # theirs, in that order (it stops at the first that is not)
    floors = [0.0] * len(structures)
    if ev.options.schedule in ("1f1b", "gpipe"):
        rev = Evaluator(ev.table, relaxed_cluster(cluster), ev.options, [microbatch_size])
        rev.allow_idle = ev.allow_idle
        for k, st in enumerate(structures):
            score = rev(st)
            floors[k] = score.objective_ms if score.fits else math.inf  # none fits if this does not
        work += rev.work
    every: dict[tuple, list | None] = {}  # per replica vector: many plans share one
    for k in sorted(range(len(structures)), key=lambda k: (floors[k], k)):
        st = structures[k]
        if floors[k] > min(T, best[0].objective_ms if best else math.inf) * (1 + 1e-9):
            break
        key = (st.replicas, st.degrees)
        if key not in every:
            every[key], raw = every_node_placement(st.replicas, cluster, PLACEMENT_LIMIT, st.degrees)
            work += PLACEMENT_WORK * raw
        devices = every[key]
        if devices is None or time.perf_counter() >= deadline or work + ev.work - start \
                + ev.simulation_work(m, st.num_stages, st.num_devices) * len(devices) * ways(st) > max_work:
            return Exhausted(best, False, work + ev.work - start)
        keep([ev.score_candidate(x, st) for devs in devices
              for x in recompute_sets(candidate_of(st, devs, m), sets)])
    return Exhausted(best, True, work + ev.work - start)


def relaxed_cluster(cluster: Cluster) -> Cluster:
    """One node holding as many devices as `cluster`, each as fast as its fastest and with as
    much memory as its largest, every link as fast as its fastest class and its latency the
    least: every cost of a structure there (compute, transfers, all-reduces, the memory limit)
    is at most the same cost at any placement on `cluster`, and a simulated 1F1B or GPipe
    schedule (each rank's actions in a fixed order, every start the latest of its inputs) is
    no later where no duration is longer. Recomputation: a stage that fits there without it
    fits; one that does not overflows on every device too."""
    specs = cluster.node_specs()
    fast = max(cluster.intra_node_gb_per_s, cluster.inter_node_gb_per_s)
    least = min(link_latency_us(cluster, "intra"), link_latency_us(cluster, "inter"))
    return Cluster(nodes=1, devices_per_node=cluster.num_devices,
                   device_memory_gb=max(s.device_memory_gb for s in specs), speed=max(s.speed for s in specs),
                   intra_node_gb_per_s=fast, inter_node_gb_per_s=fast, latency_us=least,
                   intra_node_latency_us=least, inter_node_latency_us=least,
                   p2p_overhead_us=cluster.p2p_overhead_us, allreduce_efficiency=cluster.allreduce_efficiency)


__all__ = ["Exhausted", "allowed_plans", "exhaust", "interchangeable_devices", "recompute_sets", "relaxed_cluster"]
