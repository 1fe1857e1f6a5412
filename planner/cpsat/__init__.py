"""CP-SAT placement: which nodes each stage's replicas take, so that the bytes crossing nodes
(pipeline sends, every microbatch both ways, and replicas' all-reduces) cost the least.

Used by the search (`planner.search`) on clusters of several nodes too large to try every
placement: the split and the replica counts are fixed, the model chooses per stage a device
count on every node; a send between two stages is priced at the intra-node link only when both
stages sit whole on one common node (the cost model's rule), an all-reduce only when its stage
sits on one node. The objective is that communication time at the cost model's bandwidths; the
plan it gives is then judged by the simulator like every other. One worker, a fixed seed and a
deterministic time limit: the same input gives the same placement.
"""

from __future__ import annotations

from collections.abc import Sequence

from ortools.sat.python import cp_model

from planner.cost import PipelineCosts, allreduce_ms, transfer_ms
from planner.formats import Cluster

UNITS_PER_MS = 1000  # objective in microseconds
DETERMINISTIC_TIME = 2.0  # CP-SAT's deterministic time units (about seconds of work)


def place_stages(replicas: Sequence[int], costs: PipelineCosts, param_bytes: Sequence[float],
                 cluster: Cluster, seed: int = 0) -> tuple[tuple[int, ...], ...] | None:
    """Ranks for every stage's replicas minimising the communication time, or None if CP-SAT
    finds no placement within its deterministic limit. `costs` gives the bytes of every send
    (`costs.sends[(s, t)].nbytes`, per microbatch)."""
    specs = cluster.node_specs()
    S, N = len(replicas), len(specs)
    ranks: list[list[int]] = [[] for _ in range(N)]
    for d in cluster.devices():
        ranks[d.node].append(d.rank)
    m = costs.num_microbatches
    lat = cluster.latency_us
    model = cp_model.CpModel()
    x = [[model.NewIntVar(0, min(replicas[s], specs[n].devices), f"x{s}_{n}") for n in range(N)]
         for s in range(S)]
    y = [[model.NewBoolVar(f"y{s}_{n}") for n in range(N)] for s in range(S)]
    single = [model.NewBoolVar(f"single{s}") for s in range(S)]
    for s in range(S):
        model.Add(sum(x[s]) == replicas[s])
        for n in range(N):
            model.Add(x[s][n] >= 1).OnlyEnforceIf(y[s][n])
            model.Add(x[s][n] == 0).OnlyEnforceIf(y[s][n].Not())
        model.Add(sum(y[s]) == 1).OnlyEnforceIf(single[s])
        model.Add(sum(y[s]) >= 2).OnlyEnforceIf(single[s].Not())
    for n in range(N):
        model.Add(sum(x[s][n] for s in range(S)) <= specs[n].devices)
    objective = []

    def ms_units(v: float) -> int:
        return int(round(v * UNITS_PER_MS))

    for (s, t), send in sorted(costs.sends.items()):
        if send.nbytes <= 0:
            continue
        extra = 2 * m * (transfer_ms(send.nbytes, cluster.inter_node_gb_per_s, lat)
                         - transfer_ms(send.nbytes, cluster.intra_node_gb_per_s, lat))
        if extra <= 0:
            continue
        together = model.NewBoolVar(f"together{s}_{t}")
        shared = []
        for n in range(N):
            both = model.NewBoolVar(f"both{s}_{t}_{n}")
            model.AddBoolAnd([y[s][n], y[t][n], single[s], single[t]]).OnlyEnforceIf(both)
            model.AddBoolOr([y[s][n].Not(), y[t][n].Not(), single[s].Not(), single[t].Not()]
                            ).OnlyEnforceIf(both.Not())
            shared.append(both)
        model.AddMaxEquality(together, shared)
        objective.append(ms_units(extra) * (1 - together))
    for s in range(S):
        if replicas[s] > 1:
            extra = allreduce_ms(param_bytes[s], replicas[s], cluster.inter_node_gb_per_s, lat) - \
                allreduce_ms(param_bytes[s], replicas[s], cluster.intra_node_gb_per_s, lat)
            if extra > 0:
                objective.append(ms_units(extra) * (1 - single[s]))
    model.Minimize(sum(objective))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = DETERMINISTIC_TIME
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    used = [0] * N
    out = []
    for s in range(S):
        got: list[int] = []
        for n in range(N):
            k = solver.Value(x[s][n])
            got += ranks[n][used[n]:used[n] + k]
            used[n] += k
        out.append(tuple(got))
    return tuple(out)
