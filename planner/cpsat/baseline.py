"""The best baseline plan: CP-SAT's hint and its fallback when the time runs out.

Internal module. Uses the core's partitioners (`planner.solve` methods `pipedream`, `blocks`,
`params`, `uniform`) when they are available, each judged by the simulator; a baseline that
fails (does not fit, or is not built) is skipped.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable

from planner.build import evaluate
from planner.cost import LayerTable
from planner.cpsat.search import throughput_objective_ms
from planner.formats import Cluster, Device, PlanOptions, Profile
from planner.partition import Candidate

log = logging.getLogger(__name__)

BASELINES = ("pipedream", "uniform", "params", "blocks")  # cheapest first
SLOW_BLOCKS = 100_000  # layers x devices above which `blocks` is not run as a hint


def baseline_method(name: str) -> Callable[[Profile, Cluster, PlanOptions], Candidate] | None:
    """The core's partitioner called `name`, or None if it is not there."""
    try:
        solve_mod = importlib.import_module("planner.solve")
    except ModuleNotFoundError:
        return None
    methods = getattr(solve_mod, "METHODS", None)
    if isinstance(methods, dict) and name in methods:
        fn = methods[name]
        return fn if callable(fn) else None
    return None


def best_baseline(profile: Profile, cluster: Cluster, options: PlanOptions, table: LayerTable,
                  devices: list[Device], budget_s: float = float("inf")
                  ) -> tuple[Candidate | None, float, str | None]:
    """(candidate, its objective in ms, method name) of the best baseline that fits: the
    simulated iteration time, or PipeDream's slowest stage with objective `throughput`."""
    best: tuple[Candidate | None, float, str | None] = (None, float("inf"), None)
    t0 = time.perf_counter()
    for name in BASELINES:
        if time.perf_counter() - t0 > budget_s:
            break  # no new baseline once its share of the time limit is spent
        if name == "blocks" and table.num_layers * len(devices) > SLOW_BLOCKS:
            continue  # its depth sweep alone can outlast the time limit (13-26 s measured)
        fn = baseline_method(name)
        if fn is None:
            continue
        try:
            opts = options.model_copy(update={"method": name})
            cand = fn(profile, cluster, opts)
            ev = evaluate(table, cluster, cand, options)
        except Exception as exc:  # a baseline that cannot plan this instance is just skipped
            log.debug("baseline %s: %s", name, exc)
            continue
        score = (ev.iteration_ms if options.objective == "iteration"
                 else throughput_objective_ms(ev.costs))
        if ev.fits and score < best[1]:
            best = (cand, score, name)
    return best
