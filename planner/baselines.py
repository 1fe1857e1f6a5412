"""The partitioners users would otherwise use, as planning methods: `uniform`, `params`,
`blocks`, and a user's own split (`manual`). PipeDream's DP lives in `planner.pipedream`.

Partition functions are pure functions over plain numbers returning stage boundaries
`[0, stop_0, ..., L]`. Device assignment (uniform/params/blocks) follows DeepSpeed's
pipe x data topology: with S stages on N devices, every stage gets N // S data-parallel
replicas on consecutive ranks (stage s = ranks s*dp .. (s+1)*dp - 1). Like a user sweeping
DeepSpeed's pipeline degree, the method tries every S that divides N (S <= layers) and keeps
the fastest simulated plan that fits memory (if none fits, the one needing least memory, so the
error says what it would take). A given `num_stages` fixes S.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from planner.build import Evaluation, evaluate, resolve_microbatch
from planner.cost import LayerTable, layer_table
from planner.errors import PipeplanError
from planner.formats import Cluster, PlanOptions, Profile
from planner.partition import Candidate, StageChoice

Bounds = list[int]


def partition_uniform(num_layers: int, num_stages: int) -> Bounds:
    """DeepSpeed's `uniform`: equal layer counts, the first `L mod S` stages one layer more."""
    size, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + size + (1 if s < extra else 0))
    return bounds


def _greedy(weights: Sequence[float], num_stages: int, cap: float) -> Bounds | None:
    """Fill stages left to right up to `cap`, each with >= 1 layer; None if S stages do not do."""
    n = len(weights)
    bounds, acc, i = [0], 0.0, 0
    while i < n:
        if weights[i] > cap:
            return None
        if i > bounds[-1] and acc + weights[i] > cap:
            bounds.append(i)
            acc = 0.0
            if len(bounds) - 1 >= num_stages:
                return None
            continue
        acc += weights[i]
        i += 1
    bounds.append(n)
    # fewer stages than asked: split the longest stages (never raises the maximum)
    return _split_longest(bounds, num_stages)


def _split_longest(bounds: Bounds, num_stages: int) -> Bounds | None:
    """`bounds` with stages split until there are `num_stages`: each time the longest stage
    (the first of equals) gives its first layer to a stage of its own; None if the longest
    has one layer. The pieces split off have one layer, so they are never the longest of a
    stage that can still be split: a heap over the original stages gives the same splits as
    rescanning the list each time (that took minutes for thousands of stages)."""
    heap = [(a - z, k) for k, (a, z) in enumerate(zip(bounds, bounds[1:], strict=False))]
    heapq.heapify(heap)  # (-length, index): the longest first, then the first of equals
    peeled = [0] * len(heap)
    for _ in range(num_stages - len(heap)):
        neg, k = heapq.heappop(heap)
        if -neg < 2:
            return None
        peeled[k] += 1
        heapq.heappush(heap, (neg + 1, k))
    out = [0]
    for k, (a, z) in enumerate(zip(bounds, bounds[1:], strict=False)):
        out += range(a + 1, a + 1 + peeled[k])  # the layers split off, one stage each
        out.append(z)
    return out


def partition_balanced(weights: Sequence[float], num_stages: int) -> Bounds:
    """DeepSpeed's `parameters` (ds_utils.partition_balanced): the contiguous split whose
    heaviest stage is lightest, by bisection on the bottleneck and a greedy probe."""
    if num_stages > len(weights):
        raise ValueError("more stages than layers")
    lo, hi = max(weights, default=0.0), float(sum(weights))
    best = _greedy(weights, num_stages, hi)
    for _ in range(100):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        probe = _greedy(weights, num_stages, mid)
        if probe is None:
            lo = mid
        else:
            hi, best = mid, probe
    probe = _greedy(weights, num_stages, lo)
    if probe is not None:
        best = probe
    assert best is not None
    return best


def block_partition(costs: Sequence[float], num_stages: int) -> Bounds:
    """torchgpipe's `balance_by_time` partition (torchgpipe.balance.blockpartition.solve), the
    algorithm of Bárány and Grinberg, "Block partitions of sequences" (Israel J. Math. 2015):
    normalise the costs to [0, 1], start from equal layer counts, and repeatedly move one layer
    from the neighbour of a lightest block towards a heaviest block until max <= min + 1.
    Unlike torchgpipe, the lightest block taken is the one closest to the heaviest, as in the
    paper; blocks the search left empty then take a layer from the nearest block that has two."""
    n = len(costs)
    if num_stages > n:
        raise ValueError("more stages than layers")
    lo = min(costs)
    span = max(costs) - lo
    normal = [0.0 if span == 0 else (x - lo) / span for x in costs]
    prefix = [0.0]
    for x in normal:
        prefix.append(prefix[-1] + x)
    splits = [n // num_stages * (x + 1) for x in range(num_stages - 1)] + [n]

    def size(i: int) -> float:
        return prefix[splits[i]] - prefix[splits[i - 1] if i > 0 else 0]

    for _ in range(10 * n * num_stages + 100):  # Bárány's argument bounds the moves; be safe
        max_size, p = max((size(i), i) for i in range(num_stages))
        done = False
        while True:
            min_size = min(size(i) for i in range(num_stages))
            if max_size <= min_size + 1:
                done = True
                break
            q = min((i for i in range(num_stages) if size(i) <= min_size),
                    key=lambda i: (abs(i - p), i))
            if p < q:  # move the last element of B(q-1) to Bq
                h = q - 1
                splits[h] -= 1
            else:  # move the first element of B(q+1) to Bq
                h = q + 1
                splits[q] += 1
            if p == h:
                break
            max_size = size(p)
        if done:
            break
    return _fill_empty_blocks([0] + splits)


def _fill_empty_blocks(bounds: Bounds) -> Bounds:
    """Give every empty block a layer from the nearest block with two or more, shifting the
    blocks in between. An empty block means min = 0, so every block is <= 1 (normalised); the
    blocks that change end no heavier than 1 (one element, or fewer than before), so a partition
    with max <= min + 1 keeps that bound."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    while 0 in lengths:
        i = lengths.index(0)
        j = min((k for k in range(len(lengths)) if lengths[k] >= 2), key=lambda k: abs(k - i))
        lengths[j] -= 1
        lengths[i] += 1
    out = [0]
    for x in lengths:
        out.append(out[-1] + x)
    return out


def _candidate(bounds: Bounds, stage_devices: list[tuple[int, ...]], b: int, m: int,
               solver: dict[str, object]) -> Candidate:
    return Candidate(tuple(StageChoice(a, z, d) for a, z, d in
                           zip(bounds[:-1], bounds[1:], stage_devices, strict=True)), b, m, solver)


def sweep_depths(profile: Profile, cluster: Cluster, options: PlanOptions, name: str,
                 partition: Callable[[LayerTable, int], Bounds], num_stages: int | None = None,
                 too_costly: Callable[[int], bool] | None = None) -> Candidate:
    """Try each pipeline depth S (DeepSpeed's pipe x data grid); keep the best (module doc).
    `too_costly` (the search, whose seeds these are): whether simulating depth S would pass the
    work it allows; that depth and the deeper ones (each costs more) are not tried, and if not
    even the first is, a PipeplanError."""
    t0 = time.perf_counter()
    table = layer_table(profile)
    b, m = resolve_microbatch(profile, options)
    N, L = cluster.num_devices, table.num_layers
    depths = [num_stages] if num_stages else [S for S in range(1, min(N, L) + 1) if N % S == 0]
    best: Evaluation | None = None
    for S in depths:
        if S > L:
            raise PipeplanError(f"{name}: {S} stages but the profile has only {L} layers")
        if too_costly is not None and too_costly(S):
            depths = depths[:depths.index(S)]
            break
        dp = N // S
        devs = [tuple(range(s * dp, (s + 1) * dp)) for s in range(S)]
        cand = _candidate(partition(table, S), devs, b, m, {})
        ev = evaluate(table, cluster, cand, options, record=False)  # times and memory only
        key = (not ev.fits, ev.memory_overshoot() if not ev.fits else ev.iteration_ms)
        if best is None or key < (not best.fits, best.memory_overshoot() if not best.fits else best.iteration_ms):
            best = ev
    if best is None:
        raise PipeplanError(f"{name}: no pipeline depth within the work allowed")
    solver = {"name": name, "status": "HEURISTIC", "objective": best.iteration_ms,
              "wall_s": time.perf_counter() - t0, "depths_tried": len(depths)}
    return Candidate(best.candidate.stages, b, m, solver)


def _layer_costs(table: LayerTable) -> list[float]:
    return [table.compute_ms(i, i + 1) for i in range(table.num_layers)]


def solve_uniform(profile: Profile, cluster: Cluster, options: PlanOptions,
                  too_costly: Callable[[int], bool] | None = None) -> Candidate:
    """Equal numbers of layers per stage (DeepSpeed's `uniform`, torchtitan's default)."""
    return sweep_depths(profile, cluster, options, "uniform",
                        lambda t, S: partition_uniform(t.num_layers, S), too_costly=too_costly)


def solve_params(profile: Profile, cluster: Cluster, options: PlanOptions,
                 too_costly: Callable[[int], bool] | None = None) -> Candidate:
    """Balanced parameter bytes per stage (DeepSpeed's default `parameters`)."""
    return sweep_depths(profile, cluster, options, "params", lambda t, S: partition_balanced(
        [t.param_bytes(i, i + 1) - t.buffer_bytes(i, i + 1) for i in range(t.num_layers)], S),
        too_costly=too_costly)


def solve_blocks(profile: Profile, cluster: Cluster, options: PlanOptions) -> Candidate:
    """torchgpipe's `balance_by_time` block partition on per-layer fwd + bwd time."""
    return sweep_depths(profile, cluster, options, "blocks",
                        lambda t, S: block_partition(_layer_costs(t), S))


SHOWN_VALUES = 16  # of a per-stage list a message repeats (a split of 10**5 stages was echoed whole)


def _listed(values: list[int] | list[bool]) -> str:
    """`values` as a flag takes them, cut after SHOWN_VALUES with how many there are in all."""
    shown = ",".join(str(int(v)) for v in values[:SHOWN_VALUES])
    return shown if len(values) <= SHOWN_VALUES else f"{shown},… ({len(values)} values)"


def solve_manual(profile: Profile, cluster: Cluster, options: PlanOptions) -> Candidate:
    """The user's split (`options.split`: layers per stage; `options.replicas`: replicas per
    stage, default 1), on consecutive ranks from 0."""
    if not options.split:
        raise PipeplanError("method manual needs --split, the number of layers per stage, e.g. "
                            "--split 3,3,2 (and optionally --replicas 1,1,2)")
    L, N = len(profile.layers), cluster.num_devices
    if sum(options.split) != L:
        raise PipeplanError(f"--split {_listed(options.split)} covers "
                            f"{sum(options.split)} layers but the profile has {L}")
    replicas = options.replicas or [1] * len(options.split)
    if len(replicas) != len(options.split):
        raise PipeplanError("--replicas: give one count per stage of --split")
    tps = getattr(options, "tp", None) or [1] * len(options.split)
    if len(tps) != len(options.split):
        raise PipeplanError("--tp: give one degree per stage of --split")
    need = sum(r * t for r, t in zip(replicas, tps, strict=True))
    if need > N and options.replicas is None and not any(t > 1 for t in tps):
        raise PipeplanError(f"--split {_listed(options.split)} gives {len(options.split)} "
                            f"stages, one device each, but the cluster has {N} devices: give at "
                            f"most {N} stages")
    if need > N:
        raise PipeplanError(f"--replicas {_listed(replicas)}"
                            + (f" with --tp {_listed(tps)}" if any(t > 1 for t in tps) else "")
                            + f" needs {need} devices but the cluster has {N}")
    b, m = resolve_microbatch(profile, options)
    idle = [s for s, r in enumerate(replicas) if r > m]
    if idle:  # microbatches go round robin over a stage's replicas: the rest get none
        raise PipeplanError(
            f"--replicas {_listed(replicas)}: stage {idle[0]} has {replicas[idle[0]]} "
            f"replicas but an iteration has {m} microbatch{'es' if m > 1 else ''} of {b}, so "
            f"{replicas[idle[0]] - m} of them would get none: give at most {m} replicas per stage, "
            "or smaller microbatches (--microbatch-size)")
    bounds, devs, rank = [0], [], 0
    for n_layers, r, t in zip(options.split, replicas, tps, strict=True):
        bounds.append(bounds[-1] + n_layers)
        devs.append(tuple(range(rank, rank + r * t)))
        rank += r * t
    cand = _candidate(bounds, devs, b, m, {"name": "manual", "status": "GIVEN"})
    if any(t > 1 for t in tps):  # replica-major ranks: replica k of stage s is t consecutive ranks
        cand = replace(cand, stages=tuple(replace(st, tp=t) for st, t in zip(cand.stages, tps, strict=True)))
    return with_recompute(cand, options)


def with_recompute(candidate: Candidate, options: PlanOptions) -> Candidate:
    """The manual plan's `--recompute` flags (one 0/1 per stage) on its stages."""
    flags = options.recompute
    if not flags:
        return candidate
    if len(flags) != len(candidate.stages):
        raise PipeplanError(f"--recompute gives {len(flags)} flags but the plan has "
                            f"{len(candidate.stages)} stages: give one 0 or 1 per stage")
    if any(flags) and not options.allow_recompute:
        raise PipeplanError("--recompute asks for recomputation but --no-recompute forbids it")
    return replace(candidate, stages=tuple(replace(st, recompute=bool(f))
                                           for st, f in zip(candidate.stages, flags, strict=True)))
