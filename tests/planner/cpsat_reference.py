"""Brute force over every plan of a small instance, judged by the core's simulator: the
reference the CP-SAT planner is tested against. Independent of `planner.cpsat`.

A plan is a split of the layers into contiguous stages, a replica count per stage and a
placement. Devices of one node are identical, so a placement is fully described by how many
devices each stage takes on each node; every such matrix that fits the nodes is tried (for the
cost only the set of nodes a stage touches matters, so matrices with the same sets are
simulated once). The only pruning is exact: a plan whose busiest rank is busy longer than the
best simulated time so far cannot be better, since a rank's busy time never exceeds the
makespan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from planner.build import evaluate
from planner.cost import layer_table
from planner.formats import Cluster, PlanOptions, Profile
from planner.partition import Candidate, StageChoice


@dataclass(frozen=True)
class Best:
    iteration_ms: float
    candidate: Candidate | None
    simulated: int  # plans simulated


def splits(num_layers: int):
    """Every split into contiguous stages, as boundary lists [0, ..., L]."""
    for S in range(1, num_layers + 1):
        for cuts in itertools.combinations(range(1, num_layers), S - 1):
            yield [0, *cuts, num_layers]


def _stage_options(free: list[int], t: int = 1):
    """Every per-node device-count vector a stage can take from the free counts (>= 1 device);
    with TP degree t, multiples of t on every node (a TP group stays in one node)."""
    ranges = [range(0, f + 1, t) for f in free]
    for vec in itertools.product(*ranges):
        if sum(vec) >= 1:
            yield vec


def _placements(degrees: list[int], free: list[int]):
    if not degrees:
        yield []
        return
    for vec in _stage_options(free, degrees[0]):
        rest = [f - v for f, v in zip(free, vec, strict=True)]
        for tail in _placements(degrees[1:], rest):
            yield [vec, *tail]


def tp_degrees(profile: Profile, cluster: Cluster, options: PlanOptions) -> list[int]:
    """1 and every degree every layer was profiled at that fits a node and `max_tp`."""
    per_node = max(s.devices for s in cluster.node_specs())
    cap = min(per_node, options.max_tp if options.max_tp is not None else per_node)
    common = set.intersection(*[{x.degree for x in (layer.tp or [])} for layer in profile.layers])
    return [1, *sorted(t for t in common if t <= cap)]


def ranks_by_node(cluster: Cluster) -> list[list[int]]:
    """The device ranks of each node, in order."""
    out: list[list[int]] = [[] for _ in cluster.node_specs()]
    for d in cluster.devices():
        out[d.node].append(d.rank)
    return out


def placed_stages(bounds: list[int], placement: list, ranks_of_node: list[list[int]],
                  tps: tuple[int, ...] | list[int]) -> list[StageChoice]:
    """The stages of a split placed by per-node device counts (`_placements`), each node's
    devices taken in order."""
    used = [0] * len(ranks_of_node)
    stages = []
    for s, vec in enumerate(placement):
        ranks: list[int] = []
        for n, v in enumerate(vec):
            ranks += ranks_of_node[n][used[n]:used[n] + v]
            used[n] += v
        stages.append(StageChoice(bounds[s], bounds[s + 1], tuple(ranks), tp=tps[s]))
    return stages


def brute_force(profile: Profile, cluster: Cluster, options: PlanOptions,
                microbatch_sizes: list[int]) -> Best:
    """The smallest simulated iteration time over every plan that fits memory: every split,
    TP degree per stage, placement (replica counts that are powers of two only, with
    `powers_of_two`), schedule (all three with `auto`) and, where a plan does
    not fit without it, recomputation on the stages that overflow (every set of stages under
    ZB-H1)."""
    table = layer_table(profile)
    specs = cluster.node_specs()
    ranks_of_node = ranks_by_node(cluster)
    schedules = ["1f1b", "gpipe", "zb-h1"] if options.schedule == "auto" else [options.schedule]
    degrees = tp_degrees(profile, cluster, options)
    best_ms, best_c, simulated = float("inf"), None, 0
    for b in microbatch_sizes:
        m = options.global_batch // b
        scale = b / profile.batch_size
        for bounds in splits(table.num_layers):
            S = len(bounds) - 1
            for tps in itertools.product(degrees, repeat=S):
                seen: set[tuple] = set()
                for placement in _placements(list(tps), [s.devices for s in specs]):
                    key = tuple((tuple(n for n, v in enumerate(vec) if v), sum(vec)) for vec in placement)
                    if key in seen:
                        continue
                    seen.add(key)
                    if options.powers_of_two and any((sum(vec) // t) & (sum(vec) // t - 1)
                                                     for vec, t in zip(placement, tps, strict=True)):
                        continue
                    busy = 0.0
                    for s, vec in enumerate(placement):
                        speed = min(specs[n].speed for n, v in enumerate(vec) if v)
                        r = sum(vec) // tps[s]
                        a, z = bounds[s], bounds[s + 1]
                        ms = table.compute_ms(a, z) if tps[s] == 1 else \
                            table.at_degree(tps[s]).span("fwd_prefix_ms", a, z) \
                            + table.at_degree(tps[s]).span("bwd_prefix_ms", a, z)
                        busy = max(busy, -(-m // r) * scale * ms / speed)
                    if busy >= best_ms:
                        continue
                    stages = placed_stages(bounds, placement, ranks_of_node, tps)
                    for name in schedules:
                        opts = options.model_copy(update={"microbatch_size": b, "microbatch_sizes": None,
                                                          "schedule": name})
                        cand = Candidate(tuple(stages), b, m, schedule=name)
                        ev = evaluate(table, cluster, cand, opts)
                        simulated += 1
                        tries = [(ev, cand)]
                        if not ev.fits and options.allow_recompute:
                            # 1F1B / GPipe: the stages that overflow must recompute (a stage's
                            # memory is its own) and recomputing any other only adds time (both
                            # tested in test_search_joint.py), so that one set is the best.
                            # ZB-H1 caps each stage's deferred W's by the busiest stage's peak,
                            # so one stage's recomputation can move another's memory: every set
                            over = {s for s in range(S)
                                    if ev.stage_memory_bytes[s] > ev.costs.memory_limit_bytes[s]}
                            plain = [s for s in range(S) if tps[s] == 1]
                            if name == "zb-h1":
                                sets = [set(c) for k in range(1, len(plain) + 1)
                                        for c in itertools.combinations(plain, k)]
                            else:
                                sets = [over] if over <= set(plain) else []
                            for subset in sets:
                                rc = Candidate(tuple(StageChoice(x.start, x.stop, x.devices, s in subset, x.tp)
                                                     for s, x in enumerate(stages)), b, m, schedule=name)
                                tries.append((evaluate(table, cluster, rc, opts), rc))
                                simulated += 1
                        for e, c in tries:
                            if e.fits and e.iteration_ms < best_ms:
                                best_ms, best_c = e.iteration_ms, c
    return Best(best_ms, best_c, simulated)


def brute_force_throughput(profile: Profile, cluster: Cluster, options: PlanOptions,
                           microbatch_size: int) -> float:
    """PipeDream's objective on one level (every device one unit, one bandwidth: intra-node on
    one node, inter-node across nodes; chain cuts), minimised over every split and replica
    vector: max over stages of compute / r + all-reduce / m, and 2 transfer(cut) / r_next."""
    from planner.cost import allreduce_ms, transfer_ms

    table = layer_table(profile)
    specs = cluster.node_specs()
    bw = cluster.intra_node_gb_per_s if len(specs) == 1 else cluster.inter_node_gb_per_s
    D = cluster.num_devices
    m = options.global_batch // microbatch_size
    scale = microbatch_size / profile.batch_size
    cuts = table.cut_bytes()
    best = float("inf")
    for bounds in splits(table.num_layers):
        S = len(bounds) - 1
        for reps in itertools.product(range(1, D + 1), repeat=S):
            if sum(reps) > D:
                continue
            worst = 0.0
            for s in range(S):
                a, z, r = bounds[s], bounds[s + 1], reps[s]
                worst = max(worst, scale * table.compute_ms(a, z) / r
                            + allreduce_ms(table.param_bytes(a, z), r, bw, cluster.latency_us) / m)
                if s + 1 < S:
                    cut = scale * cuts[z - 1]
                    worst = max(worst, 2 * transfer_ms(cut, bw, cluster.latency_us) / reps[s + 1])
            best = min(best, worst)
    return best
