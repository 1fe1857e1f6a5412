"""Verified search: CP-SAT minimises a lower bound of the simulated iteration time; every
solution is placed on real ranks and simulated; a solution whose bound is below the best
simulated time is cut off (a no-good) and the model is solved again, until the model's optimum
reaches the best simulated time (proven optimal) or the time runs out.

Internal module. The bound is exact on most plans (see `model.py`), so the loop usually ends
after one or two solves; it stays correct when it is not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from planner.build import evaluate
from planner.cost import LayerTable, PipelineCosts
from planner.cpsat.decode import StageStructure, place_stages, structure_of
from planner.cpsat.instance import Instance, replica_buckets
from planner.cpsat.model import Handles, build_model
from planner.formats import Cluster, Device, PlanOptions
from planner.partition import Candidate

EXACT_SLOTS = 24  # up to this many slots the in-flight products are modelled exactly


@dataclass
class SearchResult:
    candidate: Candidate | None
    iteration_ms: float  # simulated
    model_ms: float | None  # the model's objective for that candidate (None: not from the model)
    bound_ms: float  # proven lower bound of every plan of the search space
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN
    solves: int = 0
    log: list[str] = field(default_factory=list)


def throughput_objective_ms(costs: PipelineCosts) -> float:
    """PipeDream's objective of a costed candidate: its slowest stage per microbatch."""
    m = costs.num_microbatches
    worst = 0.0
    for s, devs in enumerate(costs.stage_devices):
        r = len(devs)
        worst = max(worst, (costs.fwd_ms[s] + costs.bwd_ms[s]) / r, costs.allreduce_ms[s] / m)
        if s >= 1:
            worst = max(worst, 2 * costs.sends[(s - 1, s)].ms / r)
    return worst


def _solver(seconds: float, seed: int, h: Handles | None = None) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(seconds, 0.01)
    # one worker: deterministic for a given seed (a parallel portfolio is not), and on a
    # shared 2-core machine it measured faster than two interleaved workers
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    if h is not None and h.slots <= EXACT_SLOTS:
        # small models: branch on the structure in slot order; robust where the default
        # single-worker search sometimes stalls on the weak linear relaxation
        solver.parameters.search_branching = cp_model.FIXED_SEARCH
    return solver


def read_structure(h: Handles, solver: cp_model.CpSolver, inst: Instance) -> list[StageStructure]:
    L = inst.num_layers
    out: list[StageStructure] = []
    for j in range(h.slots):
        if not solver.Value(h.act[j]):
            break
        stop = L if j == 0 else solver.Value(h.e[j - 1])
        p = next(p for p, v in enumerate(h.opt[j]) if solver.Value(v))
        same = j >= 1 and solver.Value(h.same[j]) == 1
        out.append(StageStructure(
            solver.Value(h.e[j]), stop, solver.Value(h.r[j]), p,
            tuple(solver.Value(v) for v in h.y[j]), same))
    out.reverse()
    return out


def _slot_literals(h: Handles, stages: list[StageStructure]) -> list[tuple[object, int]]:
    """(variable, value) pairs that pin a structure: stage k sits in slot j = S-1-k, and
    same[j] (j >= 1) links slot j (stage S-1-j) with slot j-1 (stage S-j)."""
    pins: list[tuple[object, int]] = []
    S = len(stages)
    for k, st in enumerate(stages):
        j = S - 1 - k
        pins.append((h.e[j], st.start))
        pins.append((h.r[j], st.replicas))
        for p, v in enumerate(h.opt[j]):
            pins.append((v, int(p == st.placement)))
        for c, v in enumerate(h.y[j]):
            pins.append((v, st.per_class[c]))
        if j >= 1:
            pins.append((h.same[j], int(st.same_node_as_next)))
    if S < h.slots:
        pins.append((h.act[S], 0))
    return pins


def add_hint(h: Handles, stages: list[StageStructure]) -> None:
    for var, val in _slot_literals(h, stages):
        h.model.AddHint(var, val)
    S = len(stages)
    for k, st in enumerate(stages):
        j = S - 1 - k
        for i, (lo, hi) in enumerate(h.buckets):
            h.model.AddHint(h.q[j][i], int(lo <= st.replicas <= hi))


def add_nogood(h: Handles, stages: list[StageStructure]) -> None:
    """At least one of the structure's pinned values must change."""
    bools = {id(v) for row in h.opt for v in row} | {id(v) for v in h.same if v is not None}
    bools |= {id(v) for v in h.act}
    lits = []
    for var, val in _slot_literals(h, stages):
        if id(var) in bools:
            lits.append(var.Not() if val else var)
        else:
            d = h.model.NewBoolVar("")
            h.model.Add(var != val).OnlyEnforceIf(d)
            lits.append(d)
    h.model.AddBoolOr(lits)


def search(inst: Instance, table: LayerTable, cluster: Cluster, options: PlanOptions,
           devices: list[Device], deadline: float, incumbent: Candidate | None,
           incumbent_ms: float, max_stages: int | None = None) -> SearchResult:
    """Minimise the simulated iteration time of `inst` until `deadline` (perf_counter)."""
    J = min(max_stages or inst.num_layers, inst.num_layers, inst.num_devices)
    exact = J <= EXACT_SLOTS
    h = build_model(inst, J, exact=exact)
    best, best_ms, best_model = incumbent, incumbent_ms, None
    if incumbent is not None:
        st = structure_of(inst, incumbent, devices)
        if st is not None and len(st) <= J and all(
                any(lo <= s.replicas <= hi for lo, hi in h.buckets) for s in st):
            add_hint(h, st)
    tol = (2 * inst.num_microbatches + 8 * J + 10) / inst.unit_per_ms
    res = SearchResult(best, best_ms, None, 0.0, "UNKNOWN")
    floor_units = 0
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        solver = _solver(left, options.seed, h)
        status = solver.Solve(h.model)
        res.solves += 1
        if status == cp_model.INFEASIBLE:
            res.bound_ms = best_ms
            res.status = "OPTIMAL" if best is not None else "INFEASIBLE"
            break
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            res.bound_ms = min(best_ms, floor_units / inst.unit_per_ms - tol)
            break
        obj = solver.ObjectiveValue()
        stages = read_structure(h, solver, inst)
        cand = place_stages(inst, cluster, stages, inst.microbatch_size, inst.num_microbatches,
                            devices)
        sim_ms = float("inf")
        if cand is not None:
            ev = evaluate(table, cluster, cand, options)
            if ev.fits:
                sim_ms = (ev.iteration_ms if inst.objective == "iteration"
                          else throughput_objective_ms(ev.costs))
        res.log.append(f"solve {res.solves}: model {obj / inst.unit_per_ms:.4f} ms, "
                       f"simulated {sim_ms:.4f} ms, {solver.StatusName(status)}")
        if sim_ms <= best_ms:
            best, best_ms, best_model = cand, sim_ms, obj / inst.unit_per_ms
        if status == cp_model.FEASIBLE:
            res.bound_ms = min(best_ms, solver.BestObjectiveBound() / inst.unit_per_ms - tol)
            break
        floor_units = int(obj)
        if obj / inst.unit_per_ms >= best_ms - tol:
            res.bound_ms = min(best_ms, obj / inst.unit_per_ms - tol)
            res.status = "OPTIMAL"
            break
        add_nogood(h, stages)
        h.model.Add(h.T >= floor_units)
    res.candidate, res.iteration_ms, res.model_ms = best, best_ms, best_model
    if res.status == "UNKNOWN" and best is not None:
        res.status = "FEASIBLE"
    res.bound_ms = max(0.0, min(res.bound_ms, best_ms))
    return res


__all__ = ["SearchResult", "search", "replica_buckets"]
