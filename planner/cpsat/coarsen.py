"""Coarsening: runs of consecutive layers merged into one, so the CP-SAT model of a
1000-layer profile stays small; stages then cut only between runs (internal module).

The cuts always include the incumbent plan's stage boundaries, so the coarse model can
represent (and is hinted with) the best plan known; the proven bound of a coarsened search
comes from `bounds.dp_lower_bound` over the original layers, never from the coarse model.
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.cost import LayerTable, Tensor
from planner.partition import Candidate, StageChoice


def group_cuts(table: LayerTable, groups: int, keep: Iterable[int] = ()) -> list[int]:
    """Boundaries [0, ..., L] of about `groups` runs of equal compute, plus `keep`."""
    L = table.num_layers
    total = table.compute_ms(0, L)
    cuts = {0, L, *keep}
    if L <= groups:
        return list(range(L + 1))
    j = 1
    for i in range(1, L):
        if total > 0 and table.compute_ms(0, i) >= j * total / groups:
            cuts.add(i)
            while table.compute_ms(0, i) >= j * total / groups:
                j += 1
    return sorted(cuts)


def coarse_table(table: LayerTable, cuts: list[int]) -> LayerTable:
    """The table of the runs `cuts[g]..cuts[g+1]`: summed numbers, tensors between runs."""
    n = len(cuts) - 1
    group_of = [0] * table.num_layers
    for g in range(n):
        for i in range(cuts[g], cuts[g + 1]):
            group_of[i] = g

    def pick(prefix: tuple) -> tuple:
        return tuple(prefix[c] for c in cuts)

    tensors = []
    for t in table.tensors:
        p = -1 if t.producer < 0 else group_of[t.producer]
        cons = tuple(sorted({group_of[c] for c in t.consumers} - {p}))
        if cons:
            tensors.append(Tensor(p, cons, t.nbytes))
    return LayerTable(
        batch_size=table.batch_size,
        names=tuple(table.names[cuts[g]] for g in range(n)),
        fwd_prefix_ms=pick(table.fwd_prefix_ms), bwd_prefix_ms=pick(table.bwd_prefix_ms),
        param_prefix_bytes=pick(table.param_prefix_bytes),
        activation_prefix_bytes=pick(table.activation_prefix_bytes),
        tensors=tuple(tensors),
    )


def to_coarse(candidate: Candidate, cuts: list[int]) -> Candidate | None:
    index = {c: g for g, c in enumerate(cuts)}
    if any(s.start not in index or s.stop not in index for s in candidate.stages):
        return None
    return Candidate(tuple(StageChoice(index[s.start], index[s.stop], s.devices)
                           for s in candidate.stages),
                     candidate.microbatch_size, candidate.num_microbatches, candidate.solver)


def to_fine(candidate: Candidate, cuts: list[int]) -> Candidate:
    return Candidate(tuple(StageChoice(cuts[s.start], cuts[s.stop], s.devices)
                           for s in candidate.stages),
                     candidate.microbatch_size, candidate.num_microbatches, candidate.solver)
