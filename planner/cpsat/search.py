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
from planner.cpsat.coarsen import to_coarse, to_fine
from planner.cpsat.decode import StageStructure, place_stages, structure_of
from planner.cpsat.instance import Instance
from planner.cpsat.model import Handles, build_model
from planner.formats import Cluster, Device, PlanOptions
from planner.partition import Candidate

EXACT_SLOTS = 24  # up to this many slots the in-flight products are modelled exactly
EXACT_MICROBATCHES = 64  # beyond, in-flight counts as booleans get too many: relaxed instead
SMALL_MODEL = 160  # slots x layers up to which the search branches on the structure


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
        worst = max(worst, (costs.fwd_ms[s] + costs.bwd_ms[s]) / r + costs.allreduce_ms[s] / m)
        if s >= 1:
            worst = max(worst, 2 * costs.sends[(s - 1, s)].ms / r)
    return worst


def _solver(seconds: float, seed: int, h: Handles, inst: Instance) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(seconds, 0.01)
    solver.parameters.random_seed = seed
    if h.slots * inst.num_layers <= SMALL_MODEL:
        # small models: one worker (deterministic for a seed) branching on the structure in
        # slot order; the default single-worker search sometimes stalls on the weak relaxation
        solver.parameters.num_workers = 1
        solver.parameters.search_branching = cp_model.FIXED_SEARCH
    else:
        # large models: both cores, CP-SAT's portfolio (wall-clock limited anyway)
        solver.parameters.num_workers = 2
    return solver


class _Judge(cp_model.CpSolverSolutionCallback):
    """Simulates every improving solution of a large model as the search finds it (the model's
    bound is loose there, so a worse-looking solution may simulate better)."""

    def __init__(self, h: Handles, inst: Instance, judge_fn, good_enough) -> None:
        super().__init__()
        self.h, self.inst, self.judge_fn, self.good_enough = h, inst, judge_fn, good_enough
        self.best: tuple[Candidate, float, float] | None = None
        self.count = 0
        self.seen: set[tuple] = set()

    def on_solution_callback(self) -> None:
        stages = read_structure(self.h, self, self.inst)
        key = tuple(stages)
        if key in self.seen:
            return
        self.seen.add(key)
        self.count += 1
        cand, ms = self.judge_fn(stages)
        if cand is not None and (self.best is None or ms < self.best[1]):
            self.best = (cand, ms, self.ObjectiveValue() / self.inst.unit_per_ms)
            if self.good_enough(ms):
                self.StopSearch()


def read_structure(h: Handles, solver, inst: Instance) -> list[StageStructure]:
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
           incumbent_ms: float, max_stages: int | None = None, cuts: list[int] | None = None,
           lower_bound_ms: float = 0.0, exact: bool | None = None,
           gap_limit: float = 0.0) -> SearchResult:
    """Minimise the simulated iteration time of `inst` until `deadline` (perf_counter).

    `inst` may be coarsened (`cuts`: its layer runs' boundaries in `table`); candidates are
    mapped back to the layers of `table` before they are simulated. `lower_bound_ms` (valid for
    every plan) is added as a cut. The search also stops once the best simulated time is within
    `gap_limit` (relative) of `lower_bound_ms`."""
    J = min(max_stages or inst.num_layers, inst.num_layers, inst.num_devices)
    exact = J <= EXACT_SLOTS if exact is None else exact
    exact = exact and inst.num_microbatches <= EXACT_MICROBATCHES
    lb_units = max(0, int(lower_bound_ms * inst.unit_per_ms) - 2)
    h = build_model(inst, J, lower_bound_units=lb_units, exact=exact)
    best, best_ms, best_model = incumbent, incumbent_ms, None
    if incumbent is not None:
        coarse = incumbent if cuts is None else to_coarse(incumbent, cuts)
        st = structure_of(inst, coarse, devices) if coarse is not None else None
        if st is not None and len(st) <= J and all(
                any(lo <= s.replicas <= hi for lo, hi in h.buckets) for s in st):
            add_hint(h, st)
    def judge_fn(stages: list[StageStructure]) -> tuple[Candidate | None, float]:
        """Place a structure on ranks and simulate it (inf: does not pack or fit)."""
        cand = place_stages(inst, cluster, stages, inst.microbatch_size, inst.num_microbatches,
                            devices)
        if cand is None:
            return None, float("inf")
        if cuts is not None:
            cand = to_fine(cand, cuts)
        ev = evaluate(table, cluster, cand, options)
        if not ev.fits:
            return cand, float("inf")
        return cand, (ev.iteration_ms if inst.objective == "iteration"
                      else throughput_objective_ms(ev.costs))

    tol = (2 * inst.num_microbatches + 8 * J + 10) / inst.unit_per_ms
    res = SearchResult(best, best_ms, None, 0.0, "UNKNOWN")
    floor_units = lb_units
    def close_enough(ms: float) -> bool:
        return (gap_limit > 0 and lower_bound_ms > 0 and ms < float("inf")
                and (ms - lower_bound_ms) <= gap_limit * ms)

    while True:
        if lower_bound_ms > 0 and best_ms <= lower_bound_ms * (1 + 1e-9):
            res.bound_ms = lower_bound_ms  # the incumbent meets a bound valid for every plan
            res.status = "OPTIMAL"
            break
        if close_enough(best_ms):
            res.bound_ms = lower_bound_ms
            break
        left = deadline - time.perf_counter()
        if left <= 0.005:
            res.bound_ms = min(best_ms, floor_units / inst.unit_per_ms - tol)
            break
        solver = _solver(left, options.seed, h, inst)
        judge = (_Judge(h, inst, judge_fn, close_enough)
                 if h.slots * inst.num_layers > SMALL_MODEL else None)
        status = solver.Solve(h.model, judge)
        res.solves += 1
        if judge is not None and judge.best is not None and judge.best[1] < best_ms:
            best, best_ms, best_model = judge.best
            res.log.append(f"solve {res.solves}: {judge.count} solutions simulated, best "
                           f"{best_ms:.4f} ms")
        if status == cp_model.INFEASIBLE:
            res.bound_ms = best_ms
            res.status = "OPTIMAL" if best is not None else "INFEASIBLE"
            break
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            res.bound_ms = min(best_ms, max(floor_units, solver.BestObjectiveBound())
                               / inst.unit_per_ms - tol)
            break
        obj = solver.ObjectiveValue()
        stages = read_structure(h, solver, inst)
        cand, sim_ms = judge_fn(stages)
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


__all__ = ["SearchResult", "search"]
