"""CP-SAT planner: stage boundaries, replicas, placement and microbatching that minimise the
simulated 1F1B iteration time under memory limits, with a proven bound on how far from optimal
the answer can be.

`solve(profile, cluster, options) -> Candidate` is the method `cpsat` of `planner.solve`.
The model (`model.py`) minimises a lower bound of the simulated time that is exact on the
paths deciding a pipeline's makespan; `search.py` simulates each solution with the core's
simulator and cuts off those whose bound lied, so the returned plan is optimal for the
simulator when the status is OPTIMAL. The best baseline plan is the hint and the fallback.
"""

from __future__ import annotations

import time

from planner.build import resolve_microbatch
from planner.cost import layer_table
from planner.cpsat.baseline import best_baseline
from planner.cpsat.diagnose import infeasible_error
from planner.cpsat.instance import build_instance
from planner.cpsat.search import SearchResult, search
from planner.formats import Cluster, PlanOptions, Profile
from planner.partition import Candidate

__all__ = ["solve", "solve_detailed"]


def microbatch_sizes(profile: Profile, options: PlanOptions) -> list[int]:
    if options.microbatch_sizes:
        return sorted(set(options.microbatch_sizes))
    return [resolve_microbatch(profile, options)[0]]


def solve_detailed(profile: Profile, cluster: Cluster, options: PlanOptions,
                   max_stages: int | None = None) -> tuple[Candidate, list[SearchResult]]:
    """The plan and, per microbatch size tried, what the search found."""
    t0 = time.perf_counter()
    deadline = t0 + options.time_limit_s
    table = layer_table(profile)
    devices = cluster.devices()
    sizes = [b for b in microbatch_sizes(profile, options) if options.global_batch % b == 0]
    fallback, fallback_ms, fallback_name = best_baseline(profile, cluster, options, table, devices)
    results: list[SearchResult] = []
    for i, b in enumerate(sizes):
        share = (deadline - time.perf_counter()) / (len(sizes) - i)
        inst = build_instance(table, cluster, options, b)
        inc = fallback if fallback is not None and fallback.microbatch_size == b else None
        results.append(search(inst, table, cluster, options, devices,
                              time.perf_counter() + share, inc, fallback_ms if inc is not None else float("inf"),
                              max_stages))
    found = [r for r in results if r.candidate is not None]
    wall = time.perf_counter() - t0
    if not found and fallback is None:
        raise infeasible_error(table, cluster, options.optimizer, options.schedule, sizes,
                               options.global_batch)
    best = min(found, key=lambda r: r.iteration_ms) if found else None
    if best is None or (fallback is not None and fallback_ms < best.iteration_ms):
        assert fallback is not None
        info = {"name": "cpsat", "status": "FALLBACK", "objective": fallback_ms,
                "bound": min((r.bound_ms for r in results), default=0.0), "gap": None,
                "wall_s": wall, "fallback": fallback_name}
        return _with_solver(fallback, info), results
    bound = min(r.bound_ms for r in results)
    proven = all(r.status in ("OPTIMAL", "INFEASIBLE") for r in results)
    gap = (best.iteration_ms - bound) / best.iteration_ms if best.iteration_ms > 0 else 0.0
    info = {
        "name": "cpsat",
        "status": "OPTIMAL" if proven else "FEASIBLE",
        "objective": best.iteration_ms,
        "bound": bound,
        "gap": max(gap, 0.0),
        "wall_s": wall,
        "model_objective": best.model_ms,
        "solves": sum(r.solves for r in results),
        "hint": fallback_name,
    }
    assert best.candidate is not None
    return _with_solver(best.candidate, info), results


def _with_solver(c: Candidate, info: dict[str, object]) -> Candidate:
    return Candidate(stages=c.stages, microbatch_size=c.microbatch_size,
                     num_microbatches=c.num_microbatches, solver=info)


def solve(profile: Profile, cluster: Cluster, options: PlanOptions) -> Candidate:
    """The CP-SAT plan (method `cpsat`); `candidate.solver` holds name, status, objective (the
    simulated iteration ms), bound, gap, wall_s and the model's own objective."""
    return solve_detailed(profile, cluster, options)[0]
