"""Planning methods and the one entry point `make_plan`.

A method is a function `(profile, cluster, options) -> Candidate`; the registry maps
`options.method` to it. `cpsat` (the CP-SAT model, `planner.cpsat.solve`) is imported lazily so
the other methods work without it; when it exists it is the default.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from planner.baselines import solve_blocks, solve_manual, solve_params, solve_uniform
from planner.build import build_plan, evaluate, memory_error, resolve_microbatch
from planner.cost import layer_table
from planner.errors import PipeplanError
from planner.formats import Cluster, Plan, PlanOptions, Profile
from planner.partition import Candidate
from planner.pipedream import solve_pipedream

Method = Callable[[Profile, Cluster, PlanOptions], Candidate]


def _pipedream(profile: Profile, cluster: Cluster, options: PlanOptions) -> Candidate:
    b, _ = resolve_microbatch(profile, options)
    return solve_pipedream(profile, cluster, options, b)


def _cpsat(profile: Profile, cluster: Cluster, options: PlanOptions) -> Candidate:
    from planner.search import solve  # lazy: ortools loads only when the search is asked for

    return solve(profile, cluster, options)


METHODS: dict[str, Method] = {
    "cpsat": _cpsat,
    "pipedream": _pipedream,
    "blocks": solve_blocks,
    "params": solve_params,
    "uniform": solve_uniform,
    "manual": solve_manual,
}


def cpsat_available() -> bool:
    try:
        importlib.import_module("planner.cpsat")
    except ModuleNotFoundError:
        return False
    return True


def default_method() -> str:
    return "cpsat" if cpsat_available() else "pipedream"


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise PipeplanError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def make_plan(profile: Profile, cluster: Cluster, options: PlanOptions) -> Plan:
    """Run `options.method`, then cost, schedule and simulate its candidate into a Plan.
    A plan that does not fit in device memory raises a PipeplanError saying what it needs."""
    t0 = time.perf_counter()
    candidate = get_method(options.method)(profile, cluster, options)
    table = layer_table(profile)
    ev = evaluate(table, cluster, candidate, options)
    if not ev.fits:
        raise memory_error(ev, options.method)
    plan = build_plan(profile, cluster, candidate, options, table=table, evaluation=ev)
    if "wall_s" not in candidate.solver:
        plan.solver.wall_s = time.perf_counter() - t0
    return plan


@dataclass
class MethodResult:
    method: str
    plan: Plan | None
    error: str | None
    wall_s: float


def compare(profile: Profile, cluster: Cluster, options: PlanOptions,
            methods: Iterable[str] | None = None) -> list[MethodResult]:
    """Every method (default: all but `manual` unless a split is given) on the same input; a
    method that fails (missing, no fit) reports its error instead of a plan."""
    if methods is None:
        methods = [m for m in METHODS if m != "manual" or options.split]
    out = []
    for name in methods:
        t0 = time.perf_counter()
        try:
            plan = make_plan(profile, cluster, options.model_copy(update={"method": name}))
            out.append(MethodResult(name, plan, None, time.perf_counter() - t0))
        except PipeplanError as exc:
            out.append(MethodResult(name, None, str(exc), time.perf_counter() - t0))
    return out
