"""From a CP-SAT solution to a candidate with concrete ranks, and from a candidate to the
model's structure (the hint).

Internal module. The model decides per stage how many devices of each node class it uses and
which consecutive stages share one node; here the runs of stages that share a node are packed
onto actual nodes (best fit, then a small exact search) and spread stages take what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cpsat.instance import Instance
from planner.formats import Cluster, Device
from planner.partition import Candidate, StageChoice


@dataclass(frozen=True)
class StageStructure:
    start: int
    stop: int
    replicas: int
    placement: int  # index into Instance.placements
    per_class: tuple[int, ...]  # devices of each node class
    same_node_as_next: bool


def _pack(loads: list[int], capacity: list[int]) -> list[int] | None:
    """Assign each load to a bin (exact depth-first search, largest loads first)."""
    order = sorted(range(len(loads)), key=lambda i: -loads[i])
    free = list(capacity)
    where = [-1] * len(loads)
    steps = [0]

    def place(k: int) -> bool:
        if k == len(order):
            return True
        steps[0] += 1
        if steps[0] > 20000:
            return False
        i = order[k]
        tried: set[int] = set()
        for n in sorted(range(len(free)), key=lambda n: free[n]):
            if free[n] >= loads[i] and free[n] not in tried:
                tried.add(free[n])
                free[n] -= loads[i]
                where[i] = n
                if place(k + 1):
                    return True
                free[n] += loads[i]
        return False

    return where if place(0) else None


def place_stages(inst: Instance, cluster: Cluster, stages: list[StageStructure],
                 microbatch_size: int, num_microbatches: int,
                 devices: list[Device] | None = None) -> Candidate | None:
    """Concrete ranks for a structure, or None when the node runs do not pack."""
    devices = devices if devices is not None else cluster.devices()
    free: dict[int, list[int]] = {}
    for d in devices:
        free.setdefault(d.node, []).append(d.rank)
    # runs of consecutive local stages that share one node
    runs: list[list[int]] = []
    for k, st in enumerate(stages):
        if not inst.placements[st.placement].local:
            continue
        if runs and k > 0 and stages[k - 1].same_node_as_next and runs[-1][-1] == k - 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    ranks: list[list[int]] = [[] for _ in stages]
    for c, cls in enumerate(inst.classes):
        mine = [run for run in runs if inst.placements[stages[run[0]].placement].classes[0] == c]
        loads = [sum(stages[k].replicas for k in run) for run in mine]
        where = _pack(loads, [len(free[n]) for n in cls.nodes])
        if where is None:
            return None
        for run, n in zip(mine, where, strict=True):
            node = cls.nodes[n]
            for k in run:
                take = stages[k].replicas
                ranks[k] = free[node][:take]
                free[node] = free[node][take:]
    for k, st in enumerate(stages):
        pl = inst.placements[st.placement]
        if pl.local:
            continue
        for c in pl.classes:
            need = st.per_class[c]
            # spread: take from the fullest nodes of the class, one node at a time
            nodes = sorted(inst.classes[c].nodes, key=lambda n: -len(free[n]))
            for n in nodes:
                if need == 0:
                    break
                take = min(need, len(free[n]))
                ranks[k] += free[n][:take]
                free[n] = free[n][take:]
                need -= take
            if need:
                return None
    return Candidate(
        stages=tuple(StageChoice(st.start, st.stop, tuple(ranks[k])) for k, st in enumerate(stages)),
        microbatch_size=microbatch_size, num_microbatches=num_microbatches,
    )


def structure_of(inst: Instance, candidate: Candidate, devices: list[Device]
                 ) -> list[StageStructure] | None:
    """The model's view of a candidate (for the hint); None if it uses a placement the model
    does not offer."""
    class_of_node = {n: c for c, cls in enumerate(inst.classes) for n in cls.nodes}
    out: list[StageStructure] = []
    nodes_of = [{devices[d].node for d in st.devices} for st in candidate.stages]
    for k, st in enumerate(candidate.stages):
        nodes = nodes_of[k]
        per_class = [0] * len(inst.classes)
        for d in st.devices:
            per_class[class_of_node[devices[d].node]] += 1
        local = len(nodes) == 1
        classes = tuple(c for c in range(len(inst.classes)) if per_class[c])
        try:
            p = next(i for i, pl in enumerate(inst.placements)
                     if pl.local == local and pl.classes == classes)
        except StopIteration:
            return None
        same = (k + 1 < len(candidate.stages) and local and len(nodes_of[k + 1]) == 1
                and nodes_of[k + 1] == nodes)
        out.append(StageStructure(st.start, st.stop, st.replicas, p, tuple(per_class), same))
    return out
