"""The planner's search (method `cpsat`, the default): stage boundaries, replicas, placement
and microbatch size that minimise the simulated iteration time under memory limits, with a
lower bound every plan respects and the gap between the two.

Per microbatch size:
1. a lower bound and the plan that attains it, by DP over (layers, devices) with 1F1B's round
   trips priced (`bound.py`);
2. seeds: that plan, every baseline (pipedream, uniform, params, blocks), one stage on every
   device, and the DP's plans at looser times;
then a deterministic local search from the seeds (`local.py`, budget in simulated actions), and
in a DAG once more from the DP's plans with every tensor a stage sends across its cut priced
into the hop (`_cut_seeds`, on CUT_SEED_SHARE more work; never a worse plan for it); on
clusters of several nodes, the best plan's stages placed anew: every node placement on small
clusters, and CP-SAT's placement that moves the fewest bytes across nodes (`planner.cpsat`). The plan returned is the best under `evaluate()`; its bound is the smallest
of the per-size bounds, so it holds for every microbatch size tried. Each per-size bound is
then tightened (`bound.tighten`: the cross-stage conditions, between it and the plan found)
on TIGHTEN_SHARE more work. Its DP's plans at the fastest and slowest times it found
feasible seed the search once more, on TIGHTENED_SHARE more work (`_tightened_seeds`; never a
worse plan for it): where memory binds, they start where the first seeds do not (ResNet-18 on
4 x 4 devices, tight: 3970 -> 2952 ms). Where the DP was too large to bisect before the
search, the work `_cut_seeds` would take bisects it on a coarser grid of cuts, and the search
runs once more from its plan (`_coarse_seeds`; ResNet-50 on 128 devices, tight: 2213 -> 1012
ms). Where the bound is still more than 1 % below the plan, the DP with each microbatch's
last backward tests 1 % below the plan, tracking one microbatch, then four, then all (the largest
set the work affords, `bound.prove`, on
PROOF_SHARE more work and what tightening left): failing there proves the 1 %. Where every
bound is still more than HOPELESS_GAP below the plan, no such test has proven the 1 % on the
suite, and that work goes to the search once more from the best plan instead, then on
PACK_SHARE and SPREAD_SHARE more from splits that fill memory, with one replica per stage and
with the free devices as replicas (`_packed_seeds`). Then, on POLISH_SHARE more, one descent
from the best plan with every tier of moves, the heaviest stages split at once among them
(`_polish`; never a worse plan for it): the search's own last descent rarely has work left,
and where several stages tie for the slowest no single move improves (a 200-layer chain on
16 x 1 devices at 1 GB/s, tight, 4 devices idle: 299.1 -> 294.7 ms), and last a stage's
replicas to another count paid by one other stage (`transfer_moves`: GNMT on 16 x 1, tight,
two replicas moved at once, 378.3 -> 371.4 ms, where one alone is slower), and from where it
stops, on CLIMB_SHARE of its work more, first-improvement moves (`local.climb`). Where a
bound is still below the plan, every plan that bound's DP allows at the plan's time (else at
1 % below it) is simulated at every placement, if they are few enough for EXHAUST_SHARE more
work (`exhaust.py`): that gives the optimum and proves it (or proves the 1 %), and a plan
faster than the search's is taken. Where
the DP was too large to bisect before the search and nothing found fits memory, the search
runs once more from the DP's memory-safe plan (`_memory_rescue`).

Same input, same plan: every step is deterministic and budgeted by work, not time (the
bound's bisections count their DP cells, `bound.dp_work`, and take at most a third of the budget;
the search gets what they leave). `time_limit_s` sets that budget (WORK_PER_SECOND of work per
second, fitted on a 2-core machine where a 10 s plan took a median 5.8 s). The phases after
the search take shares of it on top, so a plan may spend up to MAX_WORK (6.0) x that budget:
ResNet-18 on 128 devices with tight memory spends 2.4x, 26.5 s for a 10 s plan on our 2-core
machine. The wall clock stops the search only at WALL_NET x the time the most work takes
(`wall_net_s`: 180 s for a 10 s plan), a safety net that a machine up to three times slower,
or one whose cores other work keeps busy, does not reach. (At 1 x `time_limit_s`, on a machine
1.5-1.7x slower than that one, 71 of the 160 plan-quality rows reached it and 21 gave another
plan or bound on a rerun. At 3 x `time_limit_s`, as the net was until 2026-11-27, that
ResNet-18 plan was cut at 30.0 s while two busy processes loaded both cores.) The service runs
the search as the command line does and stops its process only past that net
(`planner.solve.solve_deadline_s`): until 2026-12-01 it set WALL_LIMIT to 1, and the real GNMT
profile on 16 devices at 1 GB/s, whose 10 s plan takes 10-12 s here, got 346.0 and 350.2 ms
from two such solves at once. The baselines seeded here sweep the pipeline depth on at most
BASELINE_SHARE of the work each (on 5,000 layers and 4,096 devices their full sweeps took three
minutes for a plan of --time-limit 0.5; 9 s now).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import numpy as np

from planner.baselines import solve_blocks, solve_params, solve_uniform
from planner.build import evaluate, resolve_microbatch
from planner.cost import (
    LayerTable,
    layer_table,
    least_layer_ms,
    microbatch_scale,
    stage_memory_bytes,
)
from planner.cpsat import place_stages
from planner.errors import PipeplanError
from planner.formats import Cluster, PlanOptions, Profile
from planner.partition import Candidate
from planner.pipedream import solve_pipedream
from planner.search.bound import (
    PROOF_GAP,
    BoundPlan,
    Conditions,
    PlanTuple,
    band_cells,
    coarse_grid,
    conditions,
    cut_hop_bytes,
    dp_work,
    feasible,
    hop_bytes,
    in_layers,
    lower_bound,
    plan_at,
    proof_conditions,
    prove,
    safe_conditions,
    tighten,
    tighten_step_work,
    without_classes,
)
from planner.search.diagnose import check_transfers, infeasible_error
from planner.search.exhaust import exhaust
from planner.search.large import dp_lower_bound
from planner.search.local import SPLIT_ONE_SHARE, Budget, climb, descend, iterated_search
from planner.search.space import (
    Evaluator,
    Score,
    Structure,
    candidate_of,
    node_placements,
    structure_of,
)

__all__ = ["solve", "solve_detailed"]

# work (about one simulated action each, when the units were fitted) per second of --time-limit
WORK_PER_SECOND = 140_000
WALL_NET = 3.0  # the wall-clock safety net, x the seconds the most work takes (`wall_net_s`)
WALL_LIMIT: float | None = None  # a hard wall-clock limit, x --time-limit (None: `wall_net_s`'s net)
GC_THRESHOLD = 50_000  # new objects between two collections while the search runs (`_fewer_collections`)
DP_SHARE = 0.35  # of the work, at most, for the bound's bisections (the search gets the rest)
BASELINE_SHARE = 0.2  # of the work, at most, for each baseline's sweep of pipeline depths (`_baselines`)
TIGHTEN_SHARE = 0.3  # more work after the search, to tighten the bound
PROOF_SHARE = 0.4  # more work after that, to prove the 1 % with each microbatch's backward (`bound.prove`)
EXHAUST_SHARE = 0.6  # more work after that, to simulate every plan the bound allows (`exhaust`)
IDLE_BOUND_SHARE = 0.2  # more work after that, to carry the bound over plans with 0-ms stages (`_idle_checked`)
RELAXATION_SAVING = 4  # a relaxation is tested first where it costs at most 1/4 (`_relaxations_first`)
WIDE_SHARE = 0.25  # more work after the search, for its compound moves (never a worse plan)
DP_CELLS = 5e7  # L * L * D * replica choices (pairs in the memory band) above which the round-trip DP is not run
OPTIMAL_GAP = 1e-6
SEED_TOL = 1e-2  # the cut-hop DP's seed plans: at most 1 % above the least time of its conditions
CUT_SEED_SHARE = 0.35  # more work after the search, for the bisection (60 %) and descents of `_cut_seeds`
TIGHTENED_SHARE = 0.3  # more work after tightening, for the search from its DP's plans (`_tightened_seeds`)
# above this gap after tightening, `prove` (1 % below the plan) is not tried: its work goes to
# the search (ResNet-101 on 16 x 1 devices, tight: 4519.6 -> 4092.5 ms, the bound as before)
HOPELESS_GAP = 0.1
PACK_SHARE = 0.4  # more work there, for the search from `_packed_seeds`
SPREAD_SHARE = 0.2  # and this much more from the same splits with the free devices as replicas
POLISH_SHARE = 0.3  # more work after every search, for one last descent with every tier of moves (`_polish`)
CLIMB_SHARE = 1.0  # of POLISH_SHARE, more, for first-improvement moves after that descent (`local.climb`)
ELITE = 2  # and the same from this many other places where the search's descents ended, on a share each
CLASS_STEPS = 12  # tightening steps the hop classes must afford, else `tighten` runs without them
# the most work a plan may spend, x the base budget (`WORK_PER_SECOND` x --time-limit): the
# search with its compound moves (the placement passes may overrun by 30 %), the cut seeds,
# tightening and the proof or, where that is out of reach, the packed and spread seeds, the
# tightened seeds and the enumeration (the memory rescue moves the net on its own)
MAX_WORK = (1.3 * (1 + WIDE_SHARE * (1 + SPLIT_ONE_SHARE)) + CUT_SEED_SHARE + TIGHTEN_SHARE
            + max(PROOF_SHARE, PROOF_SHARE + PACK_SHARE + SPREAD_SHARE) + TIGHTENED_SHARE
            + 1.3 * (2 if ELITE else 1) * POLISH_SHARE * (1 + CLIMB_SHARE)
            + EXHAUST_SHARE + IDLE_BOUND_SHARE)


def wall_net_s(time_limit_s: float) -> float:
    """When the wall clock stops a search of `time_limit_s`: WALL_NET x the time its most work
    took where WORK_PER_SECOND was fitted (a 10 s plan may spend up to MAX_WORK x 10 s of
    work), so a machine up to WALL_NET times slower, or busy with other work, still does all
    of it and gives the same plan; or WALL_LIMIT x `time_limit_s` where that is set."""
    if WALL_LIMIT is not None:
        return WALL_LIMIT * time_limit_s
    return WALL_NET * MAX_WORK * time_limit_s


def microbatch_sizes(profile: Profile, options: PlanOptions) -> list[int]:
    if options.microbatch_sizes:
        sizes = sorted({b for b in options.microbatch_sizes if options.global_batch % b == 0})
        if not sizes:
            raise PipeplanError(
                f"--microbatch-sizes {','.join(map(str, options.microbatch_sizes))}: none divides "
                f"--global-batch {options.global_batch}")
        return sizes
    return [resolve_microbatch(profile, options)[0]]


def _baselines(profile: Profile, cluster: Cluster, options: PlanOptions, b: int,
               large: bool, ev: Evaluator, max_work: float) -> list[Candidate]:
    """The baselines' plans at microbatch size b, seeds of the search. Those that sweep the
    pipeline depth stop where their simulations would pass `max_work` each (`Evaluator`'s
    units; not counted in its work): on 5,000 layers and 4,096 devices their sweeps took
    three minutes for a plan of --time-limit 0.5, where a plan-quality instance spends at
    most a few thousand units on them."""
    opts = options.model_copy(update={"microbatch_size": b, "microbatch_sizes": None})
    m = options.global_batch // b

    def capped() -> Callable[[int], bool]:
        spent = 0

        def too_costly(stages: int) -> bool:
            nonlocal spent
            spent += ev.simulation_work(m, stages, cluster.num_devices)
            return spent > max_work
        return too_costly

    out = []
    fns = [lambda: solve_pipedream(profile, cluster, opts, b), lambda: solve_uniform(profile, cluster, opts, capped()),
           lambda: solve_params(profile, cluster, opts, capped())]
    if not large:
        fns.append(lambda: solve_blocks(profile, cluster, opts))
    for fn in fns:
        try:
            out.append(fn())
        except PipeplanError:
            continue
    return out


def needs_recompute_variant(table: LayerTable, cluster: Cluster, options: PlanOptions,
                            b: int) -> bool:
    """Whether the bound must consider recomputed stages: allowed, and memory binds somewhere
    (the whole model with every microbatch in flight does not fit one device)."""
    if not options.allow_recompute:
        return False
    L = table.num_layers
    need = stage_memory_bytes(table.param_bytes(0, L), table.activation_bytes(0, L),
                              microbatch_scale(table.batch_size, b), options.global_batch // b,
                              options.optimizer, table.frozen_bytes(0, L))
    return need > max(d.memory_bytes for d in cluster.devices())


def _dp_bound(table: LayerTable, cluster: Cluster, options: PlanOptions, b: int,
              hops, upper_ms: float, lower_ms: float, degrees: tuple[int, ...], work: float
              ) -> tuple[list[BoundPlan | None], int, Conditions | None, bool]:
    """[the bound and its plan, and where memory binds or TP is allowed, plans that fit
    memory as the simulator counts it (seeds, not bounds)]; [] where the DP is not run. The
    bisections share `work` (the main bound first), and the work they spent comes back, with
    the conditions (for `tighten` after the search, also where the DP was too large to
    bisect: tightening may still afford a step or two) and whether the DP was bisected."""
    if options.objective != "iteration":
        return [], 0, None, False
    rc = needs_recompute_variant(table, cluster, options, b)
    classed = conditions(table, cluster, options.optimizer, options.schedule, options.global_batch, b,
                         hops, degrees, rc)
    # before the search, the DP without hop classes (`bound.hop_classes`: 1.4-1.8x the work a
    # step): its plans are the seeds the search was tuned on, and it bisects further; the
    # classes tighten the bound after the search
    c = without_classes(classed)
    # (i, j) pairs in the memory band, both orders: L * L where memory does not bind
    pairs = 2 * band_cells(c) - table.num_layers
    if pairs * cluster.num_devices * len(c.rs) * len(c.variants) > DP_CELLS \
            or 3 * dp_work(replace(c, grouped=False)) > work:  # too large, or not three steps to spend
        if any(v.tp > 1 for v in c.variants) or options.schedule == "zb-h1":
            return [], 0, classed, False  # the layer-only DP knows neither TP nor B / W
        found, spent = dp_lower_bound(table, cluster, options, b, upper_ms, rel_tol=1e-3,
                                      recompute=rc, max_work=work, hops=hops)
        if rc and found is not None:
            # its plan may not fit memory: a bound, not a seed (as a seed it moved the search
            # both ways: densenet121 16x1 tight +29 %, nasnetalarge 4x4 tight -11 %)
            found = replace(found, seed=False)
        return [found], spent, classed, False
    main, spent = lower_bound(c, upper_ms=upper_ms, lower_ms=lower_ms, max_work=work)
    out = [main]
    if rc or len(degrees) > 1:  # memory binds somewhere, or TP stages cannot recompute
        safes = [x for t in ((None, *degrees) if len(degrees) > 1 else (None,))
                 if (x := safe_conditions(c, t)) is not None]
        floor = main.bound_ms if main is not None else lower_ms  # safe plans are plans of c
        for k, safe in enumerate(safes):
            share = (work - spent) / (len(safes) - k)
            found, used = lower_bound(safe, upper_ms=upper_ms, rel_tol=1e-3, lower_ms=floor,
                                      max_work=share)
            out.append(found)
            spent += used
    return out, spent, classed, True


def _seed(b: int, bounds: tuple[int, ...], replicas: tuple[int, ...], tp: tuple[int, ...]) -> Structure:
    """A DP's plan as a structure the search starts from (placement policy 0)."""
    return Structure(b, bounds, replicas, 0).with_stages(bounds, replicas, tp)


PACK_SEEDS = 8  # `_packed_seeds`: at most this many, their stage counts spread evenly


def _pack(table: LayerTable, b: int, m: int, optimizer: str, cap: float, most: int) -> tuple[int, ...] | None:
    """Stages laid from the last layer back, each as long as fits `cap` bytes with the
    microbatches 1F1B keeps in flight there (one more per stage behind it); None past `most`
    stages."""
    scale = microbatch_scale(table.batch_size, b)
    bounds, j = [table.num_layers], table.num_layers
    while j > 0:
        if len(bounds) > most:
            return None
        inflight = min(m, len(bounds))
        i = j - 1
        while i > 0 and stage_memory_bytes(table.param_bytes(i - 1, j), table.activation_bytes(i - 1, j),
                                           scale, inflight, optimizer, table.frozen_bytes(i - 1, j)) <= cap:
            i -= 1
        bounds.append(i)
        j = i
    return tuple(bounds[::-1])


def _front_pack(table: LayerTable, scale: float, m: int, optimizer: str, limit: float, S: int,
                cap_ms: float) -> tuple[int, ...] | None:
    """S stages at most, laid from the first layer on, each as long as its compute stays within
    `cap_ms` and its memory within `limit` with the microbatches 1F1B keeps in flight at its
    place (min(m, S - s)); None where the layers do not fit. Greedy is exact here: a stage
    that ends later never leaves the stages after it more to hold."""
    L = table.num_layers
    bounds, i = [0], 0
    for s in range(S):
        inflight = min(m, S - s)
        j = i
        while j < L and scale * table.compute_ms(i, j + 1) <= cap_ms and stage_memory_bytes(
                table.param_bytes(i, j + 1), table.activation_bytes(i, j + 1), scale, inflight, optimizer,
                table.frozen_bytes(i, j + 1)) <= limit:
            j += 1
        if j == i:
            return None
        bounds.append(j)
        i = j
        if i == L:
            return tuple(bounds)
    return None


def _balanced_pack(table: LayerTable, b: int, m: int, optimizer: str, limit: float, S: int
                   ) -> tuple[int, ...] | None:
    """The S (or fewer) stages, one replica each, of least largest compute that fit memory
    (`_front_pack`, bisected over that compute)."""
    scale = microbatch_scale(table.batch_size, b)
    hi = scale * table.compute_ms(0, table.num_layers)
    best = _front_pack(table, scale, m, optimizer, limit, S, hi)
    if best is None:
        return None
    lo = 0.0
    for _ in range(40):
        if hi - lo <= 1e-4 * hi:
            break
        mid = (lo + hi) / 2
        got = _front_pack(table, scale, m, optimizer, limit, S, mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def _packed_seeds(table: LayerTable, cluster: Cluster, options: PlanOptions, b: int) -> list[Structure]:
    """Plans that fill memory, one replica per stage: `_pack` at the device's memory gives the
    fewest stages that fit; smaller caps (bisected) give up to `PACK_SEEDS` plans with stage
    counts spread evenly from there to the number of devices (`_spread_seeds` gives them the
    free devices as replicas). Where memory binds, a search from the best plan stays in its basin; these start where
    stages are long at the back and short at the front, at several depths (with the replicas:
    a 100-layer chain on 4 x 4 devices, tight, 120.9 -> 113.4 ms)."""
    L, D = table.num_layers, cluster.num_devices
    limit = min(d.memory_bytes for d in cluster.devices())
    m = max(1, options.global_batch // b)
    first = _pack(table, b, m, options.optimizer, limit, min(D, L))
    if first is None:
        return []
    lo_s, hi_s = len(first) - 1, min(D, L)
    want = sorted({round(lo_s + k * (hi_s - lo_s) / max(1, PACK_SEEDS - 1)) for k in range(PACK_SEEDS)})
    out: dict[tuple[int, ...], Structure] = {}

    def add(bounds: tuple[int, ...] | None) -> None:
        if bounds is not None and bounds not in out:
            n = len(bounds) - 1
            out[bounds] = _seed(b, bounds, (1,) * n, (1,) * n)

    for S in want:
        lo, hi = 0.0, limit  # the cap: below `hi` there are more stages than S (or it fails)
        best = first if len(first) - 1 == S else None
        for _ in range(30):
            mid = (lo + hi) / 2
            got = _pack(table, b, m, options.optimizer, mid, hi_s)
            if got is None or len(got) - 1 > S:
                lo = mid
            else:
                hi = mid
                if len(got) - 1 == S:
                    best = got
                    break
        add(best)
        add(_balanced_pack(table, b, m, options.optimizer, limit, S))
    return list(out.values())


def _spread_seeds(table: LayerTable, seeds: list[Structure], m: int, D: int) -> list[Structure]:
    """Each seed with fewer stages than devices once more, the free devices as replicas
    (`_spread_replicas`)."""
    return [_seed(st.microbatch_size, st.bounds, _spread_replicas(table, st.bounds, m, D), (1,) * st.num_stages)
            for st in seeds if st.num_stages < D]


def _spread_replicas(table: LayerTable, bounds: tuple[int, ...], m: int, D: int) -> tuple[int, ...]:
    """The devices a split leaves free, one at a time to the stage whose busiest replica's
    compute (ceil(m / r) microbatches) drops most with one more replica (ties: the earliest)."""
    comp = [table.compute_ms(a, z) for a, z in zip(bounds, bounds[1:], strict=False)]
    reps = [1] * len(comp)
    for _ in range(D - len(comp)):
        k = max(range(len(comp)), key=lambda k: ((-(-m // reps[k]) - -(-m // (reps[k] + 1))) * comp[k], -k))
        reps[k] += 1
    return tuple(reps)


def _cut_seeds(table: LayerTable, cluster: Cluster, options: PlanOptions, b: int, c: Conditions,
               hops: np.ndarray, lower_ms: float, upper_ms: float, max_work: float
               ) -> tuple[list[Structure], int]:
    """Seeds (not bounds) from the DP with every tensor a stage sends across its cut priced
    into the hop (`bound.cut_hop_bytes`), where that differs from the bound's hop (a DAG):
    the bound's DP prices what the next stage's first layer reads, so its plans cut residual
    blocks in the middle, where the simulator sends five times as much (ResNet-50 on 16
    devices at 1 GB/s, tight: the search's plan 8377 ms, a seed of this DP 7010 ms). Its plan
    with memory priced as the bound does or, where memory binds, as the simulator does,
    bisected to SEED_TOL on at most `max_work`. `hops`: `bound.hop_bytes(table)`. The seeds
    and the work spent."""
    cut = cut_hop_bytes(table)
    if np.array_equal(cut, hops):
        return [], 0
    seeding = conditions(table, cluster, options.optimizer, options.schedule, options.global_batch, b, cut,
                         tuple(sorted({v.tp for v in c.variants})), any(v.recompute for v in c.variants))
    if any(v.recompute for v in c.variants):
        seeding = safe_conditions(seeding) or seeding
    if 3 * dp_work(replace(seeding, grouped=False)) > max_work:
        return [], 0  # not three steps to spend (as `_dp_bound`)
    found, spent = lower_bound(seeding, upper_ms=upper_ms, rel_tol=SEED_TOL, lower_ms=lower_ms, max_work=max_work)
    if found is None:
        return [], spent
    return [_seed(b, found.bounds, found.replicas, found.tp)], spent


def _tightened_seeds(feasible_at: dict[int, list[tuple[float, PlanTuple]]]
                     ) -> list[Structure]:
    """Seeds (not bounds): per microbatch size, the plans of the tightened DP (`bound.tighten`:
    the cross-stage conditions, the prefix's hops where it affords them) at the fastest and
    the slowest time it found feasible below the plan, and the first it found (where steps are
    scarce, that of a coarser grid of cuts, `bound._narrow`). Where memory binds, the seeding
    bisection prices memory with the fewest microbatches in flight and no hop before a stage,
    and the search from its plans ends far from these (ResNet-18 on 4 x 4 devices, tight
    memory: 3970 ms; from the plan of the tightened DP at its slowest feasible time, 2952 ms;
    its fastest feasible time's plan replicates the first stage 9 times and simulates slower)."""
    out: list[Structure] = []
    for b, found in sorted(feasible_at.items()):
        if found:
            ends = {found[0], min(found, key=lambda x: x[0]), max(found, key=lambda x: x[0])}
            out += [_seed(b, bounds, reps, tps) for _, (bounds, reps, tps, _) in sorted(ends)]
    return out


COARSE_SEED_STEPS = 3  # bisection steps the coarse grid of `_coarse_seeds` must afford
# up to this many layers: above, the search's own phases take most of --time-limit already
# (NASNet, 920-1250 layers: 8-9 s of 10), and this one would reach the wall-clock safety net
COARSE_SEED_LAYERS = 600


def _coarse_seeds(c: Conditions, b: int, lower_ms: float, upper_ms: float, max_work: float
                  ) -> tuple[list[Structure], int]:
    """Seeds (not bounds) where the DP is too large to bisect before the search: the DP
    restricted to cuts at every k-th layer (`bound.restrict`: each of its plans is a plan of
    the whole DP), k the smallest power of two whose COARSE_SEED_STEPS steps fit `max_work`,
    bisected between `lower_ms` and `upper_ms`; its plan at the fastest time found feasible,
    and the work spent. The search there starts from the baselines alone, and ends far from
    this plan (ResNeXt-50 on 128 devices, tight memory: the search's plan 2730 ms; from this
    DP's plan on every 4th layer, 1233 ms)."""
    grid = coarse_grid(without_classes(c), dp_work, COARSE_SEED_STEPS, max_work)
    if grid is None:
        return [], 0
    _, cuts, coarse, step = grid
    spent, lo, hi, plan = 0, lower_ms, upper_ms, None
    while spent + step <= max_work and hi - lo > SEED_TOL * hi:
        mid = hi if spent == 0 else (math.sqrt(lo * hi) if lo > 0 else hi / 2)
        spent += step
        got = plan_at(coarse, mid)
        if got is None:
            if mid == hi:
                return [], spent  # no plan of this grid as fast as the plan found
            lo = mid
        else:
            hi, plan = mid, got
    if plan is None:
        return [], spent
    return [_seed(b, *in_layers(cuts, plan)[:3])], spent


def _memory_rescue(conds: dict[int, Conditions], degrees: tuple[int, ...], max_work: int
                   ) -> tuple[list[Structure], int]:
    """Where the round-trip DP was too large to bisect and nothing the search found fits
    memory: per microbatch size, the plan of that DP (`conds`, as `_dp_bound` built it) with
    memory priced as the simulator counts it (`safe_conditions`) and no time condition, one DP
    each (not run where one would cost more than `max_work`), and the work spent. It fits, so
    a second search starts from a plan that does; only then, so the plans of every other
    instance are unchanged."""
    out: list[Structure] = []
    work = 0
    for b, c in conds.items():
        c = without_classes(c)  # the DP the seeds came from
        for degree in sorted(set(degrees)):
            safe = safe_conditions(c, degree if len(degrees) > 1 else None)
            if safe is None or work + dp_work(safe) > max_work:
                continue
            work += dp_work(safe)
            found = plan_at(safe, math.inf)
            if found is not None:
                out.append(_seed(b, *found[:3]))
                break
    return out, work


def _exhaust_all(conds: dict[int, Conditions | None], bounds: dict[int, float], floors: dict[int, float],
                 obj: float, ev: Evaluator, cluster: Cluster, max_work: float, deadline: float
                 ) -> tuple[tuple[Score, Candidate] | None, int]:
    """Per microbatch size whose bound is below the plan's time `obj`: every plan the DP
    allows at `obj` simulated (`exhaust`), which proves the optimum; where too many, at 1 %
    below it, which proves the 1 %. Raises `bounds` in place; the best plan found faster than
    `obj` (None if none), and the work spent (at most about `max_work`, one DP at most more).
    With powers of two, the DP's plans as plans of such counts (`exhaust.powers_of_two_plans`).
    Under zb-h1 it simulates every set of
    recomputed stages (before, it ran there only where the bound's DP, its memory priced at
    the largest device, had no recomputed variant, and simulated only the recomputation of the
    stages that overflow: on two nodes of 2 and 16 GB it proved a plan 10.8 % slower than one
    that recomputes two stages). Where some layer computes nothing, the plans with a stage of
    such layers alone are simulated as well (the DP and the evaluator allow them here): what
    it proves then holds over every plan, and raises `floors` too (`_idle_checked`)."""
    spent = 0
    found: tuple[Score, Candidate] | None = None
    options = ev.options
    if options.objective != "iteration":
        return found, spent
    idle = ev.has_idle_layers()
    proven_over_all = floors if idle else bounds  # what a bound must reach to skip a size
    for b, c in conds.items():
        if c is None or proven_over_all[b] >= obj * (1 - OPTIMAL_GAP):
            continue
        cz = proof_conditions(replace(c, idle_stages=idle))
        for T in (obj, obj * (1 - PROOF_GAP)):
            left = max_work - spent
            if proven_over_all[b] >= T * (1 - OPTIMAL_GAP) or 2 * tighten_step_work(cz) > left \
                    or time.perf_counter() >= deadline:
                break
            with ev.idle_allowed() if idle else nullcontext():
                got = exhaust(cz, T, b, ev, cluster, left, deadline)
            spent += got.work
            if got.best is not None and got.best[0].objective_ms < obj * (1 - OPTIMAL_GAP) \
                    and (found is None or got.best[0].better_than(found[0])):
                found = got.best
            proven = got.bound(T)
            if proven is not None:
                bounds[b] = max(bounds[b], proven)
                floors[b] = max(floors[b], proven)
                break
    return found, spent


def _simple_bound(table: LayerTable, cluster: Cluster, options: PlanOptions, b: int,
                  degrees: tuple[int, ...]) -> float:
    """Every plan does the whole model's work on the cluster's devices, and one microbatch's
    forward and backward through every layer on the fastest one (per layer, the cheapest of
    its TP degrees: device time t x the shard's, and the shard's time)."""
    m = options.global_batch // b
    scale = microbatch_scale(table.batch_size, b)
    speeds = [d.speed for d in cluster.devices()]
    work, latency = least_layer_ms(table, degrees, options.schedule == "zb-h1")
    return max(m * scale * sum(work) / sum(speeds), scale * sum(latency) / max(speeds))


PLACEMENTS = 2000  # node placements of the best structure tried at the end


SMALL_CLUSTER = 16  # devices up to which every local optimum is placed every way on the nodes


def _polish_placement(st: Structure, score: Score, cand: Candidate | None, ev: Evaluator,
                      cluster: Cluster, limit: int = PLACEMENTS, use_cpsat: bool = False
                      ) -> tuple[Score, Candidate | None]:
    """The best structure's stages placed every way the nodes allow (up to `limit`
    placements: on mixed clusters the best order of fast and slow nodes can interleave), and
    the CP-SAT placement that moves the fewest bytes across nodes."""
    if len(cluster.node_specs()) < 2 or cand is None:
        return score, cand
    m = cand.num_microbatches
    tried = list(node_placements(st.replicas, cluster, limit, st.degrees)) \
        if cluster.num_devices <= 64 else []
    if use_cpsat and score.fits and not st.tp:
        ev_cand = evaluate(ev.table, cluster, cand, ev.options, ev.devices)
        # the bytes each stage's replicas all-reduce: its trained parameters (not frozen ones, nor buffers)
        params = [ev.table.param_bytes(a, z) - ev.table.frozen_bytes(a, z)
                  for a, z in zip(st.bounds, st.bounds[1:], strict=False)]
        devs = place_stages(st.replicas, ev_cand.costs, params, cluster, ev.options.seed)
        if devs is not None:
            tried.append(devs)
    for devs in tried:
        if ev.work > ev.work_limit:
            break
        s, c = ev.score_candidate(candidate_of(st, devs, m), st)
        if s.better_than(score):
            score, cand = s, c
    return score, cand


def _seeds_at(b: int, ev: Evaluator, L: int, D: int) -> list[Structure]:
    """One stage on every device and on one device (one replica group) per TP degree."""
    base = Structure(b, (0, L), (1,), 0)
    return [base.with_stages((0, L), (r,), (t,)) for t in ev.degrees for r in (max(1, D // t), 1)]


AUTO_SCHEDULES = ("1f1b", "zb-h1", "gpipe")  # tried in this order; the first wins ties


def _auto_key(c: Candidate) -> tuple[float, int, int]:
    """Faster first, then fewer devices, then fewer stages."""
    return (float(c.solver["objective"]), sum(len(s.devices) for s in c.stages), len(c.stages))  # type: ignore[arg-type]


def solve_detailed(profile: Profile, cluster: Cluster, options: PlanOptions
                   ) -> tuple[Candidate, dict[str, object]]:
    """The search; with `--schedule auto`, the whole search once per schedule (each with the
    full budget, so up to 3x `--time-limit`), and the best plan of the three: it is never
    worse than the plan of any fixed schedule, and its bound (the smallest of the three)
    holds for every schedule."""
    with _fewer_collections():
        return _solve_detailed(profile, cluster, options)


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """The search makes and drops millions of small objects (candidates, costs, schedules)
    while it keeps caches of thousands: at Python's default threshold the cyclic garbage
    collector ran often and traversed the caches each time, 10-16 % of a plan's time (GNMT on
    4 x 4 devices: 7.98 -> 7.15 s, ResNet-50 on 2 x 8 tight: 9.77 -> 8.64). Reference counting
    frees nearly all of it anyway; the collector's first generation waits for more objects
    while the search runs."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], GC_THRESHOLD), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _solve_detailed(profile: Profile, cluster: Cluster, options: PlanOptions
                    ) -> tuple[Candidate, dict[str, object]]:
    if options.schedule != "auto":
        return _solve_one(profile, cluster, options)
    t0 = time.perf_counter()
    best: tuple[Candidate, dict[str, object]] | None = None
    infos: dict[str, object] = {}
    errors: list[PipeplanError] = []
    found: list[tuple[Candidate, dict[str, object]]] = []
    for name in AUTO_SCHEDULES:
        try:
            cand, info = _solve_one(profile, cluster, options.model_copy(update={"schedule": name}))
        except PipeplanError as exc:
            errors.append(exc)
            # inf: no plan of this schedule fits memory (None in the file, which holds no inf)
            lost = getattr(exc, "bound_ms", 0.0)
            infos[name] = {"objective": None, "bound": lost if math.isfinite(lost) else None}
            continue
        infos[name] = {"objective": info["objective"], "bound": info["bound"],
                       "clock_stopped": info["clock_stopped"]}
        found.append((cand, info))
        if best is None or _auto_key(cand) < _auto_key(best[0]):
            best = (cand, info)
    if best is None:
        raise errors[0]
    best = _best_across_schedules(profile, cluster, options, best, found)
    cand, info = best
    obj = float(info["objective"])
    for name in AUTO_SCHEDULES:
        entry = infos[name]
        assert isinstance(entry, dict)
        if entry["bound"] is not None and float(entry["bound"]) < obj * (1 - OPTIMAL_GAP) \
                and options.objective == "iteration":
            # a schedule whose bound is below the best plan of all: every plan of it the DP
            # allows at that plan's time simulated (`_exhaust_all`), which proves none faster
            # (or finds one its own search missed): GPipe that found no plan under tight memory
            # kept its DP bound, 12.4 against a proven 15.5 ms (an outside check, 9 of 100)
            raised, faster = _schedule_below(profile, cluster, options.model_copy(update={"schedule": name}),
                                             obj)
            entry["bound"] = max(float(entry["bound"]), raised)
            if faster is not None:
                alt = replace(faster, solver={**info, "objective": float(faster.solver["objective"]),
                                              "schedule": name, "searched_as": name})
                if _auto_key(alt) < _auto_key(cand):
                    cand, info = alt, alt.solver
                    obj = float(info["objective"])
    bound = min(float(v["bound"]) for v in infos.values() if v["bound"] is not None)  # type: ignore[index]
    bound = min(bound, obj)
    gap = (obj - bound) / obj if obj > 0 else 0.0
    info = {**info, "bound": bound, "gap": gap, "status": "OPTIMAL" if gap <= OPTIMAL_GAP else "FEASIBLE",
            "wall_s": time.perf_counter() - t0, "by_schedule": infos,
            "clock_stopped": any(v.get("clock_stopped", False) for v in infos.values())}  # type: ignore[union-attr]
    return Candidate(cand.stages, cand.microbatch_size, cand.num_microbatches, info, cand.schedule), info


def _schedule_below(profile: Profile, cluster: Cluster, options: PlanOptions, T: float
                    ) -> tuple[float, Candidate | None]:
    """For `--schedule auto`: a bound of `options.schedule` where every plan of it the DP allows
    at T (each microbatch size) is simulated on EXHAUST_SHARE of a plan's work (`_exhaust_all`):
    T where none is faster (1 % below T where only that many are few enough), else 0; and the
    fastest plan found below T, if any (placed and scored as the search scores its plans)."""
    table = layer_table(profile)
    sizes = microbatch_sizes(profile, options)
    ev = Evaluator(table, cluster, options, sizes)
    hops = hop_bytes(table)
    total_work = int(WORK_PER_SECOND * options.time_limit_s)
    conds: dict[int, Conditions | None] = {}
    bounds: dict[int, float] = {}
    for b in sizes:
        conds[b] = conditions(table, cluster, options.optimizer, options.schedule, options.global_batch, b,
                              hops, ev.degrees, needs_recompute_variant(table, cluster, options, b))
        bounds[b] = 0.0
    floors = dict(bounds)
    deadline = time.perf_counter() + wall_net_s(options.time_limit_s)
    found, _ = _exhaust_all(conds, bounds, floors, T, ev, cluster, EXHAUST_SHARE * total_work, deadline)
    faster = None
    if found is not None:
        score, cand = found
        faster = Candidate(cand.stages, cand.microbatch_size, cand.num_microbatches,
                           {"objective": score.objective_ms}, options.schedule)
    return min((floors if ev.has_idle_layers() else bounds).values()), faster


def _best_across_schedules(profile: Profile, cluster: Cluster, options: PlanOptions,
                           best: tuple[Candidate, dict[str, object]],
                           found: list[tuple[Candidate, dict[str, object]]]
                           ) -> tuple[Candidate, dict[str, object]]:
    """`best`, or each schedule's plan run under another schedule where that is faster and
    fits (a short time limit can leave one schedule's search short of the stages another's
    found: a VGG-16 1F1B plan ran 2 % faster as zb-h1 than zb-h1's own search had found)."""
    if options.objective != "iteration":
        return best
    table = layer_table(profile)
    for cand, info in found:
        for name in AUTO_SCHEDULES:
            if name == cand.schedule:
                continue
            alt = Candidate(cand.stages, cand.microbatch_size, cand.num_microbatches, {}, name)
            concrete = options.model_copy(update={"schedule": name})
            try:
                ev = evaluate(table, cluster, alt, concrete, record=False)
            except (PipeplanError, ValueError):  # a stage this schedule cannot run
                continue
            if not ev.fits:
                continue
            # the plan's schedule in its solver info too (it said the schedule whose search
            # found the stages: "zb-h1" beside a plan that runs 1f1b); `searched_as` keeps that
            alt = replace(alt, solver={**info, "objective": ev.iteration_ms, "schedule": name,
                                       "searched_as": cand.schedule})
            if _auto_key(alt) < _auto_key(best[0]):
                best = (alt, alt.solver)
    return best


def _search_more(starts: list[Structure], work: float, best_s: Score, cand: Candidate, ev: Evaluator,
                 cluster: Cluster, deadline: float) -> tuple[Score, Candidate]:
    """The search once more from `starts` on `work` more, its plan placed anew (as the
    search's): that plan where it is better than `best_s`, else `best_s` and `cand` as they were."""
    ev.work_limit = max(ev.work_limit, ev.work + int(1.3 * work))
    got, got_s = iterated_search(starts, ev, ev.table, cluster.num_devices, Budget(ev.work + int(work), deadline),
                                 ev.options.seed)
    return _placed_if_better(got, got_s, best_s, cand, ev, cluster)


def _placed_if_better(got: Structure | None, got_s: Score | None, best_s: Score, cand: Candidate,
                      ev: Evaluator, cluster: Cluster) -> tuple[Score, Candidate]:
    """`got` placed anew (as the search's plan is) where it is better than `best_s`, else
    `best_s` and `cand` as they were."""
    if got is None or got_s is None or not got_s.better_than(best_s):
        return best_s, cand
    score, placed = ev.scored(got)
    score, placed = _polish_placement(got, score, placed, ev, cluster, use_cpsat=True)
    assert placed is not None
    return score, placed


def _polish(cand: Candidate, best_s: Score, ev: Evaluator, cluster: Cluster, work: float,
            deadline: float) -> tuple[Score, Candidate]:
    """One descent from `cand` with every tier of moves (`local.descend` with `split_many`,
    `wide`, `split_one` and `transfer`) on `work` more, then first-improvement moves from where
    it stopped on CLIMB_SHARE of that more (`local.climb`: where the descent's work ran out,
    they go on for a fraction of its price); then the same from the ELITE best other places
    where the search's descents ended, on `work` / ELITE each (where the search had more work
    than before, its best plan can sit in a worse basin than one it left: Inception-v3 on 4 x 4
    devices, tight, chosen microbatch, 4126.4 ms from its best plan, 3360.9 from the second).
    The best of those plans, placed anew, where it is better than `best_s`; else `best_s` and
    `cand` as they were."""
    start = structure_of(cand)
    others = sorted((s.objective_ms, st) for st, s in ev.optima.items() if st != start)
    starts = [(start, work)] + [(st, work / ELITE) for _, st in others[:ELITE]]
    for st, share in starts:
        if time.perf_counter() >= deadline:
            break
        ev.work_limit = max(ev.work_limit, ev.work + int(1.3 * (1 + CLIMB_SHARE) * share))
        got, got_s = descend(st, ev, ev.table, cluster.num_devices, Budget(ev.work + int(share), deadline),
                             wide=True, split_one=True, split_many=True, transfer=True)
        got, got_s = climb(got, ev, ev.table, Budget(ev.work + int(CLIMB_SHARE * share), deadline))
        best_s, cand = _placed_if_better(got, got_s, best_s, cand, ev, cluster)
    return best_s, cand


def _solve_one(profile: Profile, cluster: Cluster, options: PlanOptions
               ) -> tuple[Candidate, dict[str, object]]:
    t0 = time.perf_counter()
    deadline = t0 + wall_net_s(options.time_limit_s)
    table = layer_table(profile)
    sizes = microbatch_sizes(profile, options)
    check_transfers(table, cluster, microbatch_scale(table.batch_size, sizes[-1]))
    ev = Evaluator(table, cluster, options, sizes)
    D = cluster.num_devices
    large = table.num_layers * D > 100_000
    hops = hop_bytes(table)
    seeds: list[Structure] = []
    fallbacks: list[tuple[Score, Candidate]] = []  # baselines exactly as they place themselves
    bounds: dict[int, float] = {}
    floors: dict[int, float] = {}
    conds: dict[int, Conditions | None] = {}
    bisected = True  # the round-trip DP bisected for every size (else the rescue below may run)
    total_work = int(WORK_PER_SECOND * options.time_limit_s)
    seed_work = 0  # the DPs of `_cut_seeds`
    dp_allowance, dp_spent = DP_SHARE * total_work, 0  # the bound's bisections, over every size
    for k, b in enumerate(sizes):
        here = _seeds_at(b, ev, table.num_layers, D)
        seeds += here
        upper = min((ev(s).objective_ms for s in here if ev(s).fits), default=math.inf)
        for cand in _baselines(profile, cluster, options, b, large, ev, BASELINE_SHARE * total_work):
            st = structure_of(cand)
            seeds.append(st)
            score, placed = ev.score_candidate(cand, st)
            fallbacks.append((score, placed))
            if score.fits:
                upper = min(upper, score.objective_ms)
        simple = _simple_bound(table, cluster, options, b, ev.degrees)
        found, used, conds[b], done = _dp_bound(table, cluster, options, b, hops, upper, simple,
                                                ev.degrees, (dp_allowance - dp_spent) / (len(sizes) - k))
        bisected &= done
        dp_spent += used
        bp = found[0] if found else None
        bounds[b] = max(bp.bound_ms if bp else 0.0, simple)
        if done and found and bp is None and not ev.has_idle_layers():
            # the bisected DP, whose memory is priced optimistically, admits no plan at any
            # time: no plan of this size fits (a plan with a 0-ms stage the DP leaves out may,
            # hence not with such layers). It bounds nothing: with --schedule auto, GPipe that
            # fits nowhere left the work bound as the bound of a proven 1F1B plan (59.6 % gap)
            bounds[b] = math.inf
        # what holds over plans with a 0-ms stage too: the round-trip DP leaves them out (as the
        # search does), the layer-only DP and the simple bound do not (`_idle_checked`)
        floors[b] = simple if done else bounds[b]
        seeds += [_seed(b, x.bounds, x.replicas, x.tp) for x in found if x is not None and x.seed]
    budget = Budget(total_work - dp_spent, deadline)
    wide_work = int(WIDE_SHARE * budget.work)  # the compound moves after the search (local._widen)
    # placement passes may overrun a little; the last descent (`local.SPLIT_ONE_SHARE`) comes after
    ev.work_limit = int(1.3 * (budget.work + (1 + SPLIT_ONE_SHARE) * wide_work))
    placed: list[tuple[Score, Candidate]] = []  # local optima placed every way (small clusters)
    several = len(cluster.node_specs()) > 1

    def visit(st: Structure) -> None:
        if several and D <= SMALL_CLUSTER:
            s, c = _polish_placement(st, *ev.scored(st), ev, cluster, limit=200)
            if c is not None:
                placed.append((s, c))

    best, best_s = iterated_search(seeds, ev, table, D, budget, options.seed, visit, wide_work)
    cand = None
    if best is not None:
        best_s, cand = ev.scored(best)
        best_s, cand = _polish_placement(best, best_s, cand, ev, cluster, use_cpsat=True)
    for s, c in placed:
        if s.better_than(best_s):
            best_s, cand = s, c
    for s, c in fallbacks:
        if s.better_than(best_s):
            best_s, cand = s, c
    if best_s is not None and best_s.fits and options.objective == "iteration":
        # on CUT_SEED_SHARE more work: the search once more from the DP's plans with whole
        # cuts priced into the hops (`_cut_seeds`, DAGs only); never a worse plan for it
        extra = CUT_SEED_SHARE * total_work
        more: list[Structure] = []
        for b, c in conds.items():
            if c is not None and bisected and time.perf_counter() < deadline:
                got, used = _cut_seeds(table, cluster, options, b, c, hops, bounds[b], best_s.objective_ms,
                                       0.6 * extra / len(sizes))
                more += got
                seed_work += used
        if more:
            best_s, cand = _search_more(more, 0.4 * extra, best_s, cand, ev, cluster, deadline)
    if (cand is None or best_s is None or not best_s.fits) and not bisected \
            and options.objective == "iteration":
        # nothing found fits, and the bound's DP did not run to give a plan that does: search
        # once more, from that DP's plan with memory priced as the simulator counts it, on half
        # the budget again; the DP itself only where it costs at most 4x the budget (a longer
        # --time-limit lets it run on larger instances). Only here, planning may take up to
        # ~3x --time-limit (nasnetalarge, 1250 layers on 128 devices: 29 s for 10 s): a plan
        # late is worth more than "does not fit" when one does
        rescued, used = _memory_rescue({b: c for b, c in conds.items() if c is not None},
                                       ev.degrees, 4 * total_work)
        dp_spent += used
        if rescued:
            more = total_work // 2
            ev.work_limit = ev.work + int(1.3 * more)
            got, got_s = iterated_search(rescued, ev, table, D,
                                         Budget(ev.work + more, time.perf_counter() + wall_net_s(options.time_limit_s) / 2),
                                         options.seed)
            if got is not None and got_s is not None and got_s.fits:
                best_s, cand = ev.scored(got)
            # what follows is budgeted by work as well: the safety net moves with the rescue
            # (else the wall clock, not the work, would end it on the rescued instances)
            deadline = max(deadline, time.perf_counter() + wall_net_s(options.time_limit_s) / 2)
    if not bisected and best_s is not None and best_s.fits and options.objective == "iteration" \
            and table.num_layers <= COARSE_SEED_LAYERS:
        # where the DP was too large to bisect, the search once more from its plans on a
        # coarser grid of cuts (`_coarse_seeds`), on what `_cut_seeds` takes where it was not
        extra = CUT_SEED_SHARE * total_work
        more = []
        for b, c in conds.items():
            if c is not None and math.isfinite(bounds[b]) and time.perf_counter() < deadline:
                got, used = _coarse_seeds(c, b, bounds[b], best_s.objective_ms, 0.6 * extra / len(sizes))
                more += got
                seed_work += used
        if more:
            best_s, cand = _search_more(more, 0.4 * extra, best_s, cand, ev, cluster, deadline)
    if (cand is None or best_s is None or not best_s.fits) and ev.has_idle_layers():
        found = _idle_rescue(seeds, ev, table, sizes, total_work, options.seed,
                             time.perf_counter() + wall_net_s(options.time_limit_s) / 2)
        if found is not None:
            return _idle_plan(*found, table, cluster, options, sizes, ev, t0, deadline,
                              dp_spent + seed_work, conds, floors, total_work)
    if cand is None or best_s is None or not best_s.fits:
        err = infeasible_error(table, cluster, options, sizes, ev,
                               proven=all(math.isinf(v) for v in bounds.values()))
        err.bound_ms = min(bounds.values())  # type: ignore[attr-defined]  # still a bound (inf: none fits)
        raise err
    best_s, cand = ev.idle_split(cand, best_s)
    best_s, cand = ev.zb_h1_recompute_toggled(cand, best_s)
    obj = best_s.objective_ms
    classed_conds = dict(conds)  # (the loop below may drop their hop classes)
    tighten_work = 0  # the bounds once more, with the cross-stage conditions (bound.tighten)
    todo = [b for b in sizes if conds.get(b) is not None and bounds[b] < obj * (1 - OPTIMAL_GAP)]
    feasible_at: dict[int, list[tuple[float, PlanTuple]]] = {}
    for k, b in enumerate(todo):
        share = (TIGHTEN_SHARE * total_work - tighten_work) / (len(todo) - k)
        c = conds[b]
        assert c is not None
        classed = None
        if c.hop_classes > 1 and CLASS_STEPS * tighten_step_work(replace(c, cross_stage=True)) > share:
            # too few steps with the hop classes: without them, as many steps as before them
            # (with them, ResNet-18 on 2 x 8, tight, lost its 1 % proof: 947 -> 930 ms); the
            # classes only for a probe just below the plan, where one step may prove the 1 %
            classed = c
            conds[b] = c = without_classes(c)
        got, used = tighten(c, bounds[b], obj, share, deadline=deadline, classed=classed,
                            upper_feasible=b == cand.microbatch_size, feasible_at=feasible_at.setdefault(b, []))
        bounds[b] = max(bounds[b], got)
        tighten_work += used
    # on TIGHTENED_SHARE more work: the search once more from the plans of the tightened DP
    # at the fastest and slowest times it found feasible (`_tightened_seeds`); never a worse
    # plan for it
    more = _tightened_seeds(feasible_at)
    if more and time.perf_counter() < deadline:
        best_s, cand = _search_more(more, TIGHTENED_SHARE * total_work, best_s, cand, ev, cluster, deadline)
        obj = best_s.objective_ms
    # the 1 % proven by each microbatch's last backward, a few tracked first (`bound.prove`),
    # on PROOF_SHARE and what tightening left
    left = (TIGHTEN_SHARE + PROOF_SHARE) * total_work - tighten_work
    todo = [b for b in todo if bounds[b] < obj * (1 - PROOF_GAP)]
    if todo and all(bounds[b] < obj * (1 - HOPELESS_GAP) for b in todo) and time.perf_counter() < deadline:
        # no proof of the 1 % within reach: that work searches on from the best plan instead
        # (never a worse plan for it)
        best_s, cand = _search_more([structure_of(cand)], left, best_s, cand, ev, cluster, deadline)
        # and on PACK_SHARE more, from plans that fill memory at several depths: where memory
        # binds, a search stays in the basin of its first plans (NASNet-A-Large on 2 x 8 devices,
        # tight: 5169.1 -> 2959.2 ms)
        packed = _packed_seeds(table, cluster, options, cand.microbatch_size)
        if packed and time.perf_counter() < deadline:
            best_s, cand = _search_more(packed, PACK_SHARE * total_work, best_s, cand, ev, cluster, deadline)
        # then from the same splits with the free devices as replicas, on work of their own (in
        # the same work as the others they took its descents: GNMT on 2 x 8, tight, 183.8 ->
        # 183.9 ms): a short stage with many replicas is a basin the search does not reach
        # by single moves (a 100-layer chain on 4 x 4 devices, tight: 120.9 -> 113.4 ms)
        spread = _spread_seeds(table, packed, max(1, options.global_batch // cand.microbatch_size), D)
        if spread and time.perf_counter() < deadline:
            best_s, cand = _search_more(spread, SPREAD_SHARE * total_work, best_s, cand, ev, cluster, deadline)
        obj = best_s.objective_ms
        todo = []
    # last, one descent from the best plan with every tier of compound moves, on POLISH_SHARE
    # more (the search's own last descent rarely has the work left; the phases after it have
    # none): never a worse plan for it
    if time.perf_counter() < deadline:
        best_s, cand = _polish(cand, best_s, ev, cluster, POLISH_SHARE * total_work, deadline)
        obj = best_s.objective_ms
    for k, b in enumerate(todo):
        c = conds[b]
        assert c is not None
        T = obj * (1 - PROOF_GAP)
        proven, used = prove(c, T, left / (len(todo) - k), deadline)
        if proven:
            bounds[b] = max(bounds[b], T)
        left -= used
        tighten_work += used
    found, exhaust_work = _exhaust_all(conds, bounds, floors, obj, ev, cluster, EXHAUST_SHARE * total_work, deadline)
    tighten_work += exhaust_work
    if found is not None and found[0].better_than(best_s):
        best_s, cand = found
        obj = best_s.objective_ms
    if not math.isfinite(bounds.get(cand.microbatch_size, 0.0)):
        # the layer-only DP found no plan of this size fitting memory, and here is one: its
        # conditions missed something; the size keeps the bound that needs no DP
        bounds[cand.microbatch_size] = _simple_bound(table, cluster, options, cand.microbatch_size, ev.degrees)
    if ev.has_idle_layers() and options.objective == "iteration":
        # every bound so far but the floors leaves out plans with a 0-ms stage
        idle_work = 0
        todo = [b for b in sizes if classed_conds.get(b) is not None and bounds[b] > floors[b]]
        for k, b in enumerate(todo):
            c = classed_conds[b]
            assert c is not None
            bounds[b], used = _idle_checked(c, bounds[b], floors[b], obj,
                                            (IDLE_BOUND_SHARE * total_work - idle_work) / (len(todo) - k), deadline)
            idle_work += used
        tighten_work += idle_work
    # sizes no plan of fits memory (`large.dp_lower_bound`: inf) bound nothing
    return _result(cand, obj, min(bounds.values()), options, ev, t0, deadline,
                   ev.work + dp_spent + tighten_work + seed_work, dp_spent + tighten_work, {
                       "bound_by_microbatch": {str(k): v for k, v in bounds.items() if math.isfinite(v)},
                       "no_plan_microbatch_sizes": [k for k, v in bounds.items() if not math.isfinite(v)]})


def _result(cand: Candidate, obj: float, bound: float, options: PlanOptions, ev: Evaluator,
            t0: float, deadline: float, work: float, bound_work: float, extra: dict[str, object]
            ) -> tuple[Candidate, dict[str, object]]:
    """The search's plan with its solver info: status, bound (none for another objective than
    iteration time) and gap."""
    if options.objective != "iteration":
        bound = 0.0
    bound = min(bound, obj)
    gap = (obj - bound) / obj if obj > 0 else 0.0
    info: dict[str, object] = {
        "name": "cpsat", "status": "OPTIMAL" if gap <= OPTIMAL_GAP else "FEASIBLE",
        "objective": obj, "bound": bound, "gap": gap, "wall_s": time.perf_counter() - t0,
        # past the safety net, some step ended on the clock, not on its work: not reproducible
        "clock_stopped": time.perf_counter() >= deadline,
        "evaluations": ev.evaluations, "work": work, "bound_work": bound_work,
        **extra, "schedule": options.schedule,
    }
    if any(ev.computes_nothing((s.start, s.stop)) for s in cand.stages):
        info["idle_stages"] = True  # a stage that computes nothing has devices of its own
    return Candidate(cand.stages, cand.microbatch_size, cand.num_microbatches, info,
                     options.schedule), info


IDLE_RESCUE_SHARE = 0.5  # of the budget: the search once more with 0-ms stages allowed


def _idle_checked(c: Conditions, T: float, floor: float, obj: float, work: float, deadline: float
                  ) -> tuple[float, int]:
    """A bound over every plan from `T`, a bound over the plans without a stage that computes
    nothing (the DPs before leave such stages out, as the search does), and `floor`, one over
    every plan; and the work spent. A 0-ms layer can hold much memory (what a ReLU or a
    reshape saves for its backward, an embedding's parameters): alone on a device it takes that
    off the other stages, so a plan with such a stage can be the fastest (`benchmarks/
    idle_stages.py`: 3 of 70 chains, up to 71.7 % faster), and a bound without them proved
    plans that were not the optimum. With such stages allowed (`Conditions.idle_stages`; `c`
    with its hop classes): T itself where the DP has no plan at T, without the cross-stage
    conditions and with them, each first without hop classes and node groups (a relaxation at a
    fraction of the work, `_relaxations_first`), cheapest first, then with each microbatch's
    last backward (`prove`, within `work`); else the same 1 % below `obj`; else that DP bisected up to there
    and tightened, within what `work` leaves (past it, or past `deadline`, the largest time
    found infeasible, at least `floor`)."""
    ci = replace(c, idle_stages=True)
    cross = replace(ci, cross_stage=True, prefix_hops=True, microbatch_paths=True)
    spent = 0
    tests = sorted(_relaxations_first(ci) + _relaxations_first(cross), key=lambda x: x[0])

    def none_at(t: float) -> bool:
        nonlocal spent
        for cost, cc in tests:
            spent += cost
            if not feasible(cc, t):
                return True
        proven, used = prove(ci, t, max(0.0, work - spent) / 2, deadline)
        spent += used
        return proven

    if none_at(T):
        return T, spent
    T1 = min(T, obj * (1 - PROOF_GAP))
    if T1 <= floor or time.perf_counter() >= deadline:
        return floor, spent
    if T1 < T and none_at(T1):
        return T1, spent
    found, used = lower_bound(without_classes(ci), upper_ms=T1, lower_ms=floor,
                              max_work=max(0.0, (work - spent) / 2))
    spent += used
    if found is None:  # no plan fits memory at any time, these stages or not (T1 is feasible)
        return T1, spent
    got, used = tighten(without_classes(ci), found.bound_ms, T1, max(0.0, work - spent), deadline=deadline,
                        classed=ci)
    return max(floor, found.bound_ms, got), spent + used


def _relaxations_first(c: Conditions) -> list[tuple[int, Conditions]]:
    """`c` and, before it where that costs at most 1 / RELAXATION_SAVING of `c`'s work, `c`
    without its hop classes and node groups; each with the work of one feasibility test. That
    one is a relaxation of `c` (every plan meeting `c` meets it), so where it has no plan at a
    time, neither has `c`: tested first, it proves there at a fraction of the work (Inception-v3
    on 2 x 8 devices: 131k units against 1.3M for `c` with 3 classes and the groups, the bound
    the same), and `c` itself still runs where it does not. Where it saves less, its work
    when it fails comes off what bisects after (tested on every instance, GNMT's bounds over
    plans with 0-ms stages fell by up to 1 %)."""
    def cost(x: Conditions) -> int:
        return tighten_step_work(x) if x.cross_stage else dp_work(x)

    full = cost(c)
    if c.grouped or c.hop_classes > 1:
        cheap = replace(without_classes(c), grouped=False)
        if RELAXATION_SAVING * (work := cost(cheap)) <= full:
            return [(work, cheap), (full, c)]
    return [(full, c)]


def _idle_rescue(seeds: list[Structure], ev: Evaluator, table: LayerTable, sizes: list[int],
                 total_work: int, seed: int, deadline: float) -> tuple[Score, Candidate] | None:
    """Where no plan without a stage that computes nothing fits memory: the search once more,
    on IDLE_RESCUE_SHARE more work, with such stages allowed. A 0-ms layer can hold much
    memory (an embedding's parameters, what a reshape or a pooling saves for its backward), and
    devices of its own can then be the only plans that fit: "no plan" was wrong there. Starts:
    the first search's seeds and, where there are devices enough, every layer a stage of its
    own. Only here, so every plan that fits without such a stage is unchanged."""
    ev.allow_idle = True
    ev.cache.clear()  # structures with 0-ms stages were scored as no plan
    L, D = table.num_layers, ev.cluster.num_devices
    starts = list(seeds)
    if L <= D:
        starts += [_seed(b, tuple(range(L + 1)), (1,) * L, (1,) * L) for b in sizes]
    more = int(IDLE_RESCUE_SHARE * total_work)
    ev.work_limit = ev.work + int(1.3 * more)
    got, got_s = iterated_search(starts, ev, table, D, Budget(ev.work + more, deadline), seed)
    if got is None or got_s is None or not got_s.fits:
        return None
    best_s, cand = ev.scored(got)
    if cand is None:
        return None
    best_s, cand = _polish_placement(got, best_s, cand, ev, ev.cluster)
    return (best_s, cand) if cand is not None and best_s.fits else None


def _idle_plan(best_s: Score, cand: Candidate, table: LayerTable, cluster: Cluster,
               options: PlanOptions, sizes: list[int], ev: Evaluator, t0: float, deadline: float,
               other_work: int, conds: dict[int, Conditions | None], floors: dict[int, float],
               total_work: int) -> tuple[Candidate, dict[str, object]]:
    """The plan `_idle_rescue` found, with the bound that needs no DP (`_simple_bound`), which
    holds for every plan, raised where every plan the DP allows with 0-ms stages at the plan's
    time is simulated (`_exhaust_all`, EXHAUST_SHARE of the work): there the plan is proven
    the optimum, or a faster one is found. (Without it, an outside exhaustive check saw plans
    at their optimum reported with gaps of 28-99 %: a 4-layer model on 4 devices whose 0-ms
    layer needs a device of its own for memory, 679 plans in all, said 75 %.)"""
    best_s, cand = ev.zb_h1_recompute_toggled(cand, best_s)
    # (a floor of inf, no plan of the size fitting, is not taken: here is a plan)
    floors = {b: max(f if math.isfinite(f := floors.get(b, 0.0)) else 0.0,
                     _simple_bound(table, cluster, options, b, ev.degrees)) for b in sizes}
    bounds = dict(floors)
    found, spent = _exhaust_all(conds, bounds, floors, best_s.objective_ms, ev, cluster,
                                EXHAUST_SHARE * total_work, deadline)
    if found is not None and found[0].better_than(best_s):
        best_s, cand = ev.zb_h1_recompute_toggled(found[1], found[0])
    bound = min(min(floors.values()), best_s.objective_ms)
    return _result(cand, best_s.objective_ms, bound, options, ev, t0, deadline, ev.work + other_work + spent,
                   other_work + spent, {"bound_by_microbatch": {}, "no_plan_microbatch_sizes": []})


def solve(profile: Profile, cluster: Cluster, options: PlanOptions) -> Candidate:
    """The plan of method `cpsat`; `candidate.solver` holds name, status, objective (the
    simulated iteration ms), bound, gap and wall_s."""
    return solve_detailed(profile, cluster, options)[0]
