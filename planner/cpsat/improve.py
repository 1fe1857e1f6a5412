"""Local search on a plan, judged by the simulator: the polish of large instances, where the
CP-SAT model is coarsened and its bound is loose (internal module).

First-improvement hill climbing over three kinds of moves, each evaluated by the core's cost
model and simulator: shift a stage boundary by 1, 2, 4, ... layers; take one replica from a
stage; give a stage one more device (a free one on a node it already uses if there is one).
Deterministic: moves are tried in a fixed order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from planner.build import evaluate
from planner.cost import LayerTable
from planner.formats import Cluster, PlanOptions
from planner.partition import Candidate, StageChoice


def _neighbours(cand: Candidate, devices_node: list[int]) -> Iterator[Candidate]:
    stages = list(cand.stages)
    S = len(stages)
    used = {d for s in stages for d in s.devices}
    free = [d for d in range(len(devices_node)) if d not in used]
    # boundary shifts, small first
    for step in (1, 2, 4, 8, 16, 32):
        for k in range(S - 1):
            a, b = stages[k], stages[k + 1]
            for delta in (step, -step):
                cut = a.stop + delta
                if a.start < cut < b.stop:
                    new = stages[:]
                    new[k] = StageChoice(a.start, cut, a.devices)
                    new[k + 1] = StageChoice(cut, b.stop, b.devices)
                    yield Candidate(tuple(new), cand.microbatch_size, cand.num_microbatches)
    # one replica fewer
    for k, st in enumerate(stages):
        if st.replicas > 1:
            new = stages[:]
            new[k] = StageChoice(st.start, st.stop, st.devices[:-1])
            yield Candidate(tuple(new), cand.microbatch_size, cand.num_microbatches)
    # one replica more
    if free:
        for k, st in enumerate(stages):
            nodes = {devices_node[d] for d in st.devices}
            same = [d for d in free if devices_node[d] in nodes]
            pick = same[0] if same else free[0]
            new = stages[:]
            new[k] = StageChoice(st.start, st.stop, (*st.devices, pick))
            yield Candidate(tuple(new), cand.microbatch_size, cand.num_microbatches)


def improve(table: LayerTable, cluster: Cluster, options: PlanOptions, cand: Candidate,
            cand_ms: float, deadline: float) -> tuple[Candidate, float, int]:
    """(better candidate, its simulated ms, moves evaluated) until no move helps or the
    deadline (perf_counter) passes."""
    devices_node = [d.node for d in cluster.devices()]
    evaluated = 0
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for nb in _neighbours(cand, devices_node):
            if time.perf_counter() >= deadline:
                break
            evaluated += 1
            ev = evaluate(table, cluster, nb, options)
            if ev.fits and ev.iteration_ms < cand_ms * (1 - 1e-9):
                cand, cand_ms = nb, ev.iteration_ms
                improved = True
                break
    return cand, cand_ms, evaluated
