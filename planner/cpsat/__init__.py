"""CP-SAT planner: stage boundaries, replicas, placement and microbatching that minimise the
simulated 1F1B (or GPipe) iteration time under memory limits, with a proven bound on how far
from optimal the answer can be.

`solve(profile, cluster, options) -> Candidate` is the method `cpsat` of `planner.solve`;
`candidate.solver` holds name, status (OPTIMAL | FEASIBLE | FALLBACK), objective (the
simulator's iteration ms of the plan, or PipeDream's objective with `throughput`), bound (no
plan is faster), gap, wall_s, model_objective (the CP-SAT model's own value of the plan),
solves and hint (the best baseline). How, per microbatch size:

1. the best baseline (hint and fallback) and a DP lower bound over every plan with its own
   plan (`bounds.py`); where the best plan is within 0.1 % of that bound, one more DP pass at
   just below the plan's time proves it optimal if no plan can meet the DP's conditions there;
2. the verified search (`search.py`): CP-SAT minimises a lower bound of the simulated time
   (`model.py`), each solution is placed on ranks and simulated, solutions whose bound was
   below their simulated time are cut off and the model solved again, until the model's
   optimum reaches the best simulated time: OPTIMAL. Up to 24 stage slots and 64 layers the
   model covers every plan; beyond, it runs on runs of layers with a few more slots than the
   plans known (`coarsen.py`), and its plan is polished by a local search (`improve.py`);
3. where placement cannot change the time (one node, or nodes of one device), every plan the
   DP's per-stage bounds cannot exclude is simulated (`proof.py`): OPTIMAL again.
A cluster whose bandwidth or latency makes a transfer take an infinite (or absurd) time is
a PipeplanError. Small models use one CP-SAT worker (deterministic for a seed); large ones use both cores and
their results may vary with the machine's load.
"""

from __future__ import annotations

import time

from planner.build import evaluate, resolve_microbatch
from planner.cost import LayerTable, layer_table, microbatch_scale
from planner.cpsat.baseline import best_baseline
from planner.cpsat.bounds import DPBound, dp_excludes_below, dp_lower_bound, model_value_ms
from planner.cpsat.coarsen import coarse_table, group_cuts
from planner.cpsat.diagnose import infeasible_error
from planner.cpsat.improve import improve
from planner.cpsat.instance import build_instance, check_transfers
from planner.cpsat.proof import placement_free, prove
from planner.cpsat.search import EXACT_SLOTS, SearchResult, search
from planner.formats import Cluster, Device, PlanOptions, Profile
from planner.partition import Candidate, StageChoice

__all__ = ["solve", "solve_detailed"]


def microbatch_sizes(profile: Profile, options: PlanOptions) -> list[int]:
    if options.microbatch_sizes:
        return sorted(set(options.microbatch_sizes))
    return [resolve_microbatch(profile, options)[0]]


DEFAULT_GAP_LIMIT = 1e-4  # stop a search that cannot prove optimality within 0.01% of the bound
MAX_GROUPS = 64  # more layers than this: the model sees runs of layers (coarsen.py)
FINE_DP_CELLS = 20000  # layers x devices up to which the DP bound is bisected to 1e-6
MAX_SLOTS = 16  # at most this many stages in a coarsened model (the DP bound covers the rest)


def _dp_candidate(dpb: DPBound, b: int, m: int) -> Candidate:
    """The DP bound's split and replicas on consecutive ranks."""
    stages, rank = [], 0
    for a, z, r in zip(dpb.bounds, dpb.bounds[1:], dpb.replicas, strict=False):
        stages.append(StageChoice(int(a), int(z), tuple(range(rank, rank + int(r)))))
        rank += int(r)
    return Candidate(tuple(stages), b, m)


PROOF_GAP = 1e-3  # a plan this close to the DP bound is tried as the optimum (one DP pass)


def _dp_proof(table: LayerTable, cluster: Cluster, options: PlanOptions, b: int, plan_ms: float,
              lb_ms: float) -> float:
    """A lower bound at the plan's own time (to 5e-10) if the DP conditions exclude every
    faster plan, else `lb_ms`: the bisection stops short of a plan that meets the bound."""
    below = plan_ms / (1 + 5e-10)
    if not lb_ms < below or plan_ms - lb_ms > PROOF_GAP * plan_ms:
        return lb_ms
    return below if dp_excludes_below(table, cluster, options, b, below) else lb_ms


def _search_size(profile: Profile, cluster: Cluster, options: PlanOptions, table: LayerTable,
                 devices: list[Device], b: int, deadline: float,
                 incumbent: Candidate | None, incumbent_ms: float,
                 max_stages: int | None, gap_limit: float) -> SearchResult:
    """One microbatch size: DP bound and its plan, then the verified CP-SAT search (on a
    coarsened model for large instances)."""
    L, D = table.num_layers, cluster.num_devices
    m = options.global_batch // b
    dpb = None
    if options.objective == "iteration":
        upper = incumbent_ms if incumbent is not None else 1e12
        start = time.perf_counter()
        # bisect to 1e-6 where a DP pass is cheap: the bound then decides gaps of 0.01 %
        dpb = dp_lower_bound(table, cluster, options, b, upper,
                             rel_tol=1e-6 if L * D <= FINE_DP_CELLS else 2e-3,
                             deadline=start + 0.3 * max(deadline - start, 0.0))
        if dpb is not None:
            cand = _dp_candidate(dpb, b, m)
            ev = evaluate(table, cluster, cand, options)
            if ev.fits and ev.iteration_ms < incumbent_ms:
                incumbent, incumbent_ms = cand, ev.iteration_ms
        if dpb is not None and incumbent is not None:
            lb_ms = _dp_proof(table, cluster, options, b, incumbent_ms, dpb.bound_ms)
            if lb_ms > dpb.bound_ms:
                dpb = DPBound(lb_ms, dpb.bounds, dpb.replicas)
    restricted = L > MAX_GROUPS or min(L, D, max_stages or L) > EXACT_SLOTS
    if restricted and incumbent is not None and placement_free(cluster) \
            and options.objective == "iteration":
        # polish the incumbent, then try to prove it by enumerating what could beat it
        now = time.perf_counter()
        incumbent, incumbent_ms, n = improve(table, cluster, options, incumbent, incumbent_ms,
                                             now + 0.2 * max(deadline - now, 0.0))
        proof = prove(table, cluster, options, incumbent, incumbent_ms,
                      now + 0.5 * max(deadline - now, 0.0))
        if proof is not None:
            return SearchResult(proof.candidate, proof.iteration_ms, None, proof.iteration_ms,
                                "OPTIMAL", 0, [f"local search: {n} moves simulated",
                                               f"enumeration: {proof.plans} plans that could "
                                               "be faster simulated"])
    cuts = None
    model_table = table
    if restricted:
        keep = [s.start for s in incumbent.stages] if incumbent is not None else []
        cuts = group_cuts(table, MAX_GROUPS, keep)
        model_table = coarse_table(table, cuts)
        # enough slots for the plans known (memory may force many stages)
        known = max([len(incumbent.stages) if incumbent is not None else 0,
                     len(dpb.bounds) - 1 if dpb is not None else 0]) + 4
        max_stages = min(max_stages or 10**9, max(MAX_SLOTS, known))
    inst = build_instance(model_table, cluster, options, b)
    lb = dpb.bound_ms if dpb is not None else 0.0
    # large instances: half of what is left for CP-SAT, the rest to polish its plan
    search_end = deadline if not restricted else \
        time.perf_counter() + 0.5 * max(deadline - time.perf_counter(), 0.0)
    res = search(inst, table, cluster, options, devices, search_end, incumbent, incumbent_ms,
                 max_stages, cuts, lb, exact=not restricted,
                 gap_limit=gap_limit if restricted else 0.0)  # small models: prove optimality
    if restricted and res.candidate is not None and options.objective == "iteration" \
            and not (lb > 0 and res.iteration_ms - lb <= gap_limit * res.iteration_ms):
        cand, ms, n = improve(table, cluster, options, res.candidate, res.iteration_ms, deadline)
        res.log.append(f"local search: {n} moves simulated, {res.iteration_ms:.4f} -> {ms:.4f} ms")
        if ms < res.iteration_ms:
            res.candidate, res.iteration_ms, res.model_ms = cand, ms, None
    if res.candidate is not None and res.status != "OPTIMAL" and time.perf_counter() < deadline:
        proof = prove(table, cluster, options, res.candidate, res.iteration_ms, deadline)
        if proof is not None:
            res.log.append(f"enumeration: {proof.plans} plans that could be faster simulated")
            res.candidate, res.iteration_ms = proof.candidate, proof.iteration_ms
            res.bound_ms, res.status = proof.iteration_ms, "OPTIMAL"
            return res
    if res.candidate is not None and res.status != "OPTIMAL" and dpb is not None:
        lb = max(lb, _dp_proof(table, cluster, options, b, res.iteration_ms, lb))
    if restricted:
        # the coarse, capped model proves nothing about the full space: only the DP bound does
        res.bound_ms = min(lb, res.iteration_ms)
        res.status = "FEASIBLE" if res.candidate is not None else "UNKNOWN"
        if res.candidate is not None and res.iteration_ms <= lb * (1 + 1e-9):
            res.status = "OPTIMAL"  # it meets the DP bound, valid for every plan
    else:
        res.bound_ms = min(max(res.bound_ms, lb), res.iteration_ms)
        if res.candidate is not None and res.iteration_ms <= lb * (1 + 1e-9):
            res.status = "OPTIMAL"  # it meets the DP bound, valid for every plan
        if res.candidate is not None:
            # the model's own value for the returned plan (it may have come from a hint)
            res.model_ms = model_value_ms(inst, res.candidate, devices, max_stages, 2.0)
    return res


def solve_detailed(profile: Profile, cluster: Cluster, options: PlanOptions,
                   max_stages: int | None = None, gap_limit: float = DEFAULT_GAP_LIMIT
                   ) -> tuple[Candidate, list[SearchResult]]:
    """The plan and, per microbatch size tried, what the search found. The search stops at
    the time limit, at a proof of optimality, or once the plan is within `gap_limit` of the
    proven bound (status FEASIBLE with that gap)."""
    t0 = time.perf_counter()
    deadline = t0 + options.time_limit_s
    table = layer_table(profile)
    devices = cluster.devices()
    sizes = [b for b in microbatch_sizes(profile, options) if options.global_batch % b == 0]
    for b in sizes[-1:]:  # the largest microbatch moves the most bytes
        check_transfers(table, cluster, microbatch_scale(table.batch_size, b))
    # no new baseline once 40% of the time limit is spent (on 1024 devices `blocks` alone
    # can take longer than the whole limit)
    share = 0.4
    fallback, fallback_ms, fallback_name = best_baseline(profile, cluster, options, table, devices,
                                                         share * options.time_limit_s)
    results: list[SearchResult] = []
    for i, b in enumerate(sizes):
        share = (deadline - time.perf_counter()) / (len(sizes) - i)
        inc = fallback if fallback is not None and fallback.microbatch_size == b else None
        results.append(_search_size(profile, cluster, options, table, devices, b,
                                    time.perf_counter() + share, inc,
                                    fallback_ms if inc is not None else float("inf"), max_stages,
                                    gap_limit))
    found = [r for r in results if r.candidate is not None]
    if not found and fallback is None:
        # nothing within the budget: every baseline, however long it takes, before giving up
        fallback, fallback_ms, fallback_name = best_baseline(profile, cluster, options, table,
                                                             devices)
    wall = time.perf_counter() - t0
    if not found and fallback is None:
        raise infeasible_error(table, cluster, options.optimizer, options.schedule, sizes,
                               options.global_batch)
    best = min(found, key=lambda r: r.iteration_ms) if found else None
    bound = min((r.bound_ms for r in results if r.candidate is not None or r.status == "INFEASIBLE"),
                default=0.0)
    if best is None or (fallback is not None and fallback_ms < best.iteration_ms):
        assert fallback is not None
        info = {"name": "cpsat", "status": "FALLBACK", "objective": fallback_ms,
                "bound": min(bound, fallback_ms), "gap": None, "wall_s": wall,
                "fallback": fallback_name}
        return _with_solver(fallback, info), results
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
