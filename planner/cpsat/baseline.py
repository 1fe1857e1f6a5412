"""The best baseline plan: CP-SAT's hint and its fallback when the time runs out.

Internal module. Uses the core's partitioners (`planner.solve` methods `pipedream`, `blocks`,
`params`, `uniform`), each judged by the simulator; a baseline that fails (does not fit) is
skipped.
"""

from __future__ import annotations

import logging
import time

from planner.build import evaluate
from planner.cost import LayerTable
from planner.cpsat.search import throughput_objective_ms
from planner.formats import Cluster, Device, PlanOptions, Profile
from planner.partition import Candidate
from planner.solve import METHODS

log = logging.getLogger(__name__)

BASELINES = ("pipedream", "uniform", "params", "blocks")  # cheapest first
SLOW_BLOCKS = 100_000  # layers x devices above which `blocks` is not run as a hint


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
        fn = METHODS[name]
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
