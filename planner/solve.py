"""Planning methods and the one entry point `make_plan`.

A method is a function `(profile, cluster, options) -> Candidate`; the registry maps
`options.method` to it. `cpsat` (the CP-SAT model, `planner.cpsat.solve`) is imported lazily so
the other methods work without it; when it exists it is the default.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from planner.baselines import solve_blocks, solve_manual, solve_params, solve_uniform
from planner.build import Evaluation, build_plan, evaluate, memory_error, resolve_microbatch
from planner.cost import layer_table, reserved_memory_bytes
from planner.errors import PipeplanError
from planner.formats import Cluster, Plan, PlanOptions, Profile
from planner.partition import Candidate
from planner.pipedream import solve_pipedream
from planner.schedules import SCHEDULES
from planner.units import format_bytes

Method = Callable[[Profile, Cluster, PlanOptions], Candidate]
# the least a profile's layers may take in all (ms): below it (all zeros, or subnormal times)
# the plan's times, throughput and ratios are not numbers a plan.json can hold
MIN_TOTAL_MS = 1e-6


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
    if not options.microbatch_sizes and not options.microbatch_size:  # (given sizes: PlanOptions checks them)
        resolve_microbatch(profile, options)  # at most MAX_MICROBATCHES of the default size
    if options.max_tp is not None and options.max_tp > 1 and not any(x.tp for x in profile.layers):
        raise PipeplanError(f"--max-tp {options.max_tp} allows tensor parallelism, but the profile has "
                            "no layer measured at a TP degree above 1: profile the model with --tp "
                            f"{options.max_tp} (it needs a tp_plan), or leave --max-tp out")
    table = layer_table(profile)
    total = table.compute_ms(0, table.num_layers)
    if not total >= MIN_TOTAL_MS:
        raise PipeplanError(f"the profile's layers take {total:.3g} ms in all (forward and backward "
                            f"of one batch of {profile.batch_size}): at least {MIN_TOTAL_MS:g} ms is "
                            "needed to plan (the search splits the model by its forward and backward "
                            "times; optimizer steps alone do not make a pipeline). Profile the "
                            "model again (python -m planner profile), or give the layers' times in "
                            "milliseconds")
    # whole bytes, the same figure taken off every device and added back to the plan's
    # memory and limits (a fractional reserved_memory_gb made a stage that fits show 1 byte
    # above its limit: the memory got ceil, the limit int)
    reserved = float(math.ceil(reserved_memory_bytes(profile, cluster)))
    nominal, cluster = cluster, cluster.with_memory_reserved(reserved)
    if options.schedule == "auto":
        candidate, concrete, ev = _auto_schedule(profile, cluster, options, table)
    else:
        candidate = get_method(options.method)(profile, cluster, options)
        concrete = options
        ev = evaluate(table, cluster, candidate, options)
    if not ev.fits:
        err = memory_error(ev, options.method)
        if reserved > 0:
            err = PipeplanError(f"{err} (Usable memory: each device's less the "
                                f"{format_bytes(reserved)} the framework keeps for itself, "
                                "cuBLAS workspaces, as the profiler measured; set the cluster's "
                                "reserved_memory_gb to change it.)")
        raise err
    plan = build_plan(profile, cluster, candidate, concrete, table=table, evaluation=ev)
    if reserved > 0:  # the plan describes the real devices: what the runtime will measure
        plan.cluster = nominal
        for st in plan.stages:
            p = st.predicted
            p.memory_bytes += int(reserved)
            p.memory_limit_bytes += int(reserved)
            p.reserved_memory_bytes = int(reserved)  # type: ignore[attr-defined]
    if options.schedule == "auto":  # the plan records what the user asked for, and what it got
        plan.options = plan.options.model_copy(update={"schedule": "auto"})
    if "wall_s" not in candidate.solver:
        plan.solver.wall_s = time.perf_counter() - t0
    return plan


def _solves(options: PlanOptions) -> int:
    """How many solves a plan of `options` makes: one per schedule with `auto`."""
    return len(SCHEDULES) if options.schedule == "auto" else 1


def solve_seconds(options: PlanOptions) -> float:
    """The time a plan is given: `time_limit_s`, once per schedule with `auto`."""
    return options.time_limit_s * _solves(options)


def solve_deadline_s(options: PlanOptions) -> float:
    """How long a caller (the service) lets one solve of `options` run before it stops it. The
    heuristics: `solve_seconds`. The search (`cpsat`): its budget is work, not time, and it
    stops itself on the clock only at its safety net (`planner.search.wall_net_s`, once per
    schedule with `auto`), so a caller that stopped it sooner would cut the work where the
    command line does not and get another plan for the same input."""
    if options.method != "cpsat":
        return solve_seconds(options)
    from planner.search import wall_net_s  # lazy: ortools loads only when the search is asked for

    return wall_net_s(options.time_limit_s) * _solves(options)


def _auto_schedule(profile: Profile, cluster: Cluster, options: PlanOptions, table
                   ) -> tuple[Candidate, PlanOptions, Evaluation]:
    """`--schedule auto`: the search (cpsat) chooses the schedule with the partition and says
    which in `candidate.schedule`; any other method is run once per schedule and the fastest
    plan that fits is kept (1f1b first among equals)."""
    if options.method == "cpsat":
        candidate = get_method("cpsat")(profile, cluster, options)
        concrete = options.model_copy(update={"schedule": candidate.schedule or "1f1b"})
        return candidate, concrete, evaluate(table, cluster, candidate, concrete)
    best: tuple[Candidate, PlanOptions, Evaluation] | None = None
    errors = []
    for name in SCHEDULES:
        concrete = options.model_copy(update={"schedule": name})
        try:
            candidate = get_method(options.method)(profile, cluster, concrete)
        except PipeplanError as exc:
            errors.append(f"{name}: {exc}")
            continue
        ev = evaluate(table, cluster, candidate, concrete)
        if best is None or (ev.fits, -ev.iteration_ms) > (best[2].fits, -best[2].iteration_ms):
            best = (candidate, concrete, ev)
    if best is None:
        raise PipeplanError(f"--schedule auto: method {options.method!r} found no plan under "
                            f"any schedule ({'; '.join(errors)})")
    return best


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
