"""Optimality by enumeration: every plan that could beat the incumbent, simulated (internal).

`bounds.StageBounds` gives per-stage conditions that every plan meets at its own simulated
time. So the plans that could be faster than the incumbent's `T` are among those whose every
stage meets the conditions at `T` and whose replicas fit the device count; when the bound is
tight they are few. Enumerating and simulating all of them proves (or improves) the incumbent.

Only where placement cannot change the simulated time, so a split and a replica vector is a
whole plan: one node of identical devices (every link intra-node), or identical nodes of one
device each (every link and every replicated stage inter-node).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from planner.build import evaluate
from planner.cost import LayerTable
from planner.cpsat.bounds import StageBounds
from planner.formats import Cluster, PlanOptions
from planner.partition import Candidate, StageChoice

MAX_LAYERS = 200


@dataclass
class ProofResult:
    candidate: Candidate
    iteration_ms: float
    proven: bool
    plans: int  # plans simulated


def placement_free(cluster: Cluster) -> bool:
    specs = cluster.node_specs()
    same = len({(s.devices, s.speed, s.device_memory_gb) for s in specs}) == 1
    return same and (len(specs) == 1 or specs[0].devices == 1)


def prove(table: LayerTable, cluster: Cluster, options: PlanOptions, incumbent: Candidate,
          incumbent_ms: float, deadline: float, max_plans: int = 4000) -> ProofResult | None:
    """Simulate every plan that may beat `incumbent_ms`; None where this does not apply or the
    plans are too many / the time runs out (nothing proven then)."""
    L = table.num_layers
    if not placement_free(cluster) or L > MAX_LAYERS or options.objective != "iteration":
        return None
    b = incumbent.microbatch_size
    sb = StageBounds(table, cluster, options, b, all_replicas=True)
    D, rs = sb.D, sb.rs.astype(int)
    T = incumbent_ms * (1 + 1e-9)
    dp = np.full(L + 1, np.inf)
    dp[0] = 0
    oks: list[np.ndarray] = [np.zeros((0, len(rs)), dtype=bool)]
    for z in range(1, L + 1):
        ok = sb.ok(T, z, dp)
        oks.append(ok)
        cost = np.where(ok, rs[None, :], np.inf)
        dp[z] = float(np.min(dp[:z][:, None] + cost)) if z else 0.0
    if not dp[L] <= D:
        return ProofResult(incumbent, incumbent_ms, True, 0)  # nothing can be faster
    # fewest devices from layer a to the end (backwards)
    suffix = np.full(L + 1, np.inf)
    suffix[L] = 0
    for a in range(L - 1, -1, -1):
        best = np.inf
        for z in range(a + 1, L + 1):
            row = oks[z][a]
            if row.any() and suffix[z] < np.inf:
                best = min(best, int(rs[row][0]) + suffix[z])
        suffix[a] = best
    best_c, best_ms, count = incumbent, incumbent_ms, 0
    m = options.global_batch // b
    stack: list[tuple[int, int, tuple[tuple[int, int, int], ...]]] = [(0, 0, ())]
    while stack:
        a, used, stages = stack.pop()
        if a == L:
            count += 1
            if count > max_plans or time.perf_counter() > deadline:
                return None
            ranks, cur = [], 0
            for s0, s1, r in stages:
                ranks.append(StageChoice(s0, s1, tuple(range(cur, cur + r))))
                cur += r
            cand = Candidate(tuple(ranks), b, m)
            ev = evaluate(table, cluster, cand, options)
            if ev.fits and ev.iteration_ms < best_ms:
                best_c, best_ms = cand, ev.iteration_ms
            continue
        for z in range(L, a, -1):
            if suffix[z] == np.inf:
                continue
            for r in rs[oks[z][a]]:
                if used + r + suffix[z] <= D:
                    stack.append((z, used + int(r), (*stages, (a, z, int(r)))))
    return ProofResult(best_c, best_ms, True, count)
