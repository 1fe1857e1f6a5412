"""Deterministic local search over structures, every move scored by `evaluate()`.

Moves: shift a stage boundary by 1, 2, 4, ... layers; merge two adjacent stages; split a stage
at its balanced point (and one layer either side); move a replica from one stage to another;
add or drop a replica; double or halve every stage's replicas; a stage's tensor-parallel degree
one step up or down; change the placement policy; the next microbatch size up or down. Steepest
descent to a local optimum, then iterated kicks (a few random moves from a seeded generator) and
descent again, for as long as the budget of simulated actions lasts. Then, on a share of work of
its own, the same once more with compound moves (`wide_moves`: two of the moves above at once,
and every boundary re-split for new replica counts) where no single move improves: the plateaus
of slow links and tight memory, where one stage or hop sets the time and no single move
changes it. `climb` takes the first improving move instead of the best (the search's last
step, where the steepest descent's work ran out). The budget, not the clock, ends the search, so the same
input gives the same plan on an idle or a loaded machine; the wall-clock deadline is only a
safety net.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from planner.cost import LayerTable
from planner.search.large import replica_choices
from planner.search.resplit import resplit_moves
from planner.search.space import Evaluator, Score, Structure


def _balanced_split(table: LayerTable, a: int, z: int) -> int:
    """The layer index in (a, z) that halves the stage's compute most evenly."""
    total = table.compute_ms(a, z)
    best, best_d = a + 1, float("inf")
    for k in range(a + 1, z):
        d = abs(2 * table.compute_ms(a, k) - total)
        if d < best_d:
            best, best_d = k, d
    return best


def _split_positions(table: LayerTable, a: int, z: int) -> list[int]:
    """Where a split of stage [a, z) is tried: its balanced point and one layer either side."""
    mid = _balanced_split(table, a, z)
    return [p for p in sorted({mid - 1, mid, mid + 1}) if a < p < z]


def neighbours(st: Structure, table: LayerTable, ev: Evaluator) -> Iterator[Structure]:
    """Every move from `st` that can score (recomputation is not a move: `Evaluator` gives
    every structure the best recomputation for it). A move to a stage that computes nothing
    scores INFEASIBLE, never better than any score, so it is not built: on 128 devices most
    moves from a kicked plan keep such a stage."""
    return (_apply(st, mv) for mv in _moves(st, table, ev) if mv[0] is None or not ev.idle_stage(mv[0]))


# a move of `_moves`: (bounds, replicas, degrees) of the new stages, or (None, policy, None), or
# (None, None, microbatch size)
Move = tuple


def _apply(st: Structure, mv: Move) -> Structure:
    bounds, x, y = mv
    if bounds is not None:
        return st.with_stages(bounds, x, y)
    if x is not None:
        return st.with_stages(st.bounds, st.replicas, policy=x)
    return replace(st, microbatch_size=y)


def _moves(st: Structure, table: LayerTable, ev: Evaluator) -> Iterator[Move]:
    """Every move from `st` (idle stages included), unbuilt: a kick draws one of them and
    builds only that one (on 128 devices a structure has over a thousand neighbours, and building every one of
    them for each random step took a fifth of a plan's time)."""
    b, r, t = list(st.bounds), list(st.replicas), list(st.degrees)
    S = len(r)
    free = ev.cluster.num_devices - st.num_devices

    def w(bounds, reps, tps=None):
        return (bounds, reps, t if tps is None else tps)

    # boundary shifts
    for k in range(1, S):
        for step in (1, 2, 4, 8, 16, 32):
            for sign in (-1, 1):
                p = b[k] + sign * step
                if b[k - 1] < p < b[k + 1]:
                    nb = b.copy()
                    nb[k] = p
                    yield w(nb, r)
    # merges (replicas: the larger of the two, or both; degree: either)
    for k in range(S - 1):
        nb = b[: k + 1] + b[k + 2:]
        for deg in sorted({t[k], t[k + 1]}):
            for rep in sorted({max(r[k], r[k + 1]), r[k] + r[k + 1]}):
                yield w(nb, r[:k] + [rep] + r[k + 2:], t[:k] + [deg] + t[k + 2:])
    # splits
    for k in range(S):
        a, z = b[k], b[k + 1]
        if z - a < 2:
            continue
        tps = t[:k] + [t[k], t[k]] + t[k + 1:]
        for p in _split_positions(table, a, z):
            nb = b[: k + 1] + [p] + b[k + 1:]
            if r[k] >= 2:
                h = r[k] // 2
                yield w(nb, r[:k] + [r[k] - h, h] + r[k + 1:], tps)
            if free >= r[k] * t[k]:
                yield w(nb, r[:k] + [r[k], r[k]] + r[k + 1:], tps)
            elif free >= t[k]:
                yield w(nb, r[:k] + [r[k], 1] + r[k + 1:], tps)
    # replicas
    for k in range(S):
        if free >= t[k]:
            yield w(b, r[:k] + [r[k] + 1] + r[k + 1:])
        if r[k] >= 2:
            yield w(b, r[:k] + [r[k] - 1] + r[k + 1:])
            for j in range(S):
                if j != k:
                    nr = r.copy()
                    nr[k] -= 1
                    nr[j] += 1
                    yield w(b, nr)
    # the pipeline twice as wide or half as wide: every stage's replicas doubled or halved
    # (microbatches in flight per replica stay as they are, so a plan that fits still does)
    if free >= st.num_devices:
        yield w(b, [2 * x for x in r])
    if all(x % 2 == 0 for x in r):
        yield w(b, [x // 2 for x in r])
    # tensor-parallel degree: the next one up or down, on as many devices or on more / fewer
    if len(ev.degrees) > 1:
        for k in range(S):
            i = ev.degrees.index(t[k]) if t[k] in ev.degrees else 0
            for j in (i - 1, i + 1):
                if not 0 <= j < len(ev.degrees):
                    continue
                d = ev.degrees[j]
                for rep in sorted({r[k], max(1, r[k] * t[k] // d)}):
                    yield w(b, r[:k] + [rep] + r[k + 1:], t[:k] + [d] + t[k + 1:])
    for p in range(len(ev.policies)):
        if p != st.policy:
            yield (None, p, None)
    # the next microbatch size up or down (`--microbatch-sizes`), stages as they are
    if st.microbatch_size in ev.sizes:
        i = ev.sizes.index(st.microbatch_size)
        for j in (i - 1, i + 1):
            if 0 <= j < len(ev.sizes):
                yield (None, None, ev.sizes[j])


def wide_moves(st: Structure, ev: Evaluator) -> Iterator[Structure]:
    """Moves `descend` tries only where no move of `neighbours` improves (compound ones): the
    structure's boundaries re-split for its replica counts or a few others (`resplit_moves`:
    where memory binds, a replica more deepens the warm-up of every stage before it, and only
    moving their boundaries too makes it fit); two adjacent boundaries shifted together, each by up to 2 layers;
    two adjacent stages merged (the larger replica count) and the devices this frees given to
    another stage; a stage's replicas set to any other count that changes the microbatches
    each replica runs (the smallest r of each ceil(m / r): a node's worth of replicas at once)."""
    yield from resplit_moves(st, ev)
    b, r, t = list(st.bounds), list(st.replicas), list(st.degrees)
    S = len(r)
    for k in range(1, S - 1):
        for d1 in (-2, -1, 1, 2):
            for d2 in (-2, -1, 1, 2):
                nb = b.copy()
                nb[k] += d1
                nb[k + 1] += d2
                if nb[k - 1] < nb[k] < nb[k + 1] < nb[k + 2]:
                    yield st.with_stages(nb, r)
    for k in range(S - 1):
        if t[k] != t[k + 1]:
            continue
        nb, nt = b[: k + 1] + b[k + 2:], t[: k + 1] + t[k + 2:]
        nr = r[:k] + [max(r[k], r[k + 1])] + r[k + 2:]
        freed = min(r[k], r[k + 1]) * t[k]  # devices
        for j in range(S - 1):
            if j != k and freed % nt[j] == 0:
                gr = nr.copy()
                gr[j] += freed // nt[j]
                yield st.with_stages(nb, gr, nt)
    free = ev.cluster.num_devices - st.num_devices
    levels = _replica_levels(st, ev)
    for k in range(S):
        for x in levels:
            if abs(x - r[k]) > 1 and (x - r[k]) * t[k] <= free:
                yield st.with_stages(b, r[:k] + [x] + r[k + 1:])


def _replica_levels(st: Structure, ev: Evaluator) -> list[int]:
    """The replica counts that change the microbatches each replica runs at this structure's
    microbatch size: the smallest r of each ceil(m / r)."""
    m = ev.options.global_batch // st.microbatch_size
    return [int(x) for x in replica_choices(m, m)]


def split_one_moves(st: Structure, ev: Evaluator) -> Iterator[Structure]:
    """The last tier of compound moves, in one descent from the best plan after `_widen`, where
    neither `neighbours` nor `wide_moves` improves: one replica split off a stage (`[1, r - 1]`
    or `[r - 1, 1]` at its balanced point, `_split_positions`), alone or with a replica less on
    another stage. The GPT example on 16 devices, tight memory: its embedding on one device
    beside the first block on seven, 943.1 -> 932.7 ms, the brute-force optimum. (Among the single moves, or beside the other compound ones,
    they changed where the search ends on other instances, up to 22 % worse on 11 of 64; as a
    last tier inside `_widen`, gnmt_large 4x4 1.2 % worse: where kicks go from there changes.)"""
    b, r, t = list(st.bounds), list(st.replicas), list(st.degrees)
    S = len(r)
    for k in range(S):
        a, z = b[k], b[k + 1]
        if z - a < 2 or r[k] < 3:
            continue
        tps = t[:k] + [t[k], t[k]] + t[k + 1:]
        for p in _split_positions(ev.table, a, z):
            nb = b[: k + 1] + [p] + b[k + 1:]
            for pair in ([1, r[k] - 1], [r[k] - 1, 1]):
                nr = r[:k] + pair + r[k + 1:]
                yield st.with_stages(nb, nr, tps)
                for j in range(len(nr)):
                    if nr[j] >= 2 and j not in (k, k + 1):
                        yield st.with_stages(nb, nr[:j] + [nr[j] - 1] + nr[j + 1:], tps)


def split_many_moves(st: Structure, ev: Evaluator) -> Iterator[Structure]:
    """A tier of `descend` for the planner's very last descent (`planner.search._polish`): the
    n heaviest stages (compute per device) split at once at their balanced points, each half on
    as many replicas as the stage had, for every n >= 2 the free devices allow. Where several
    stages tie for the slowest, splitting one of them saves nothing and adds a hop, so no
    single move improves: a 200-layer chain on 16 x 1 devices at 1 GB/s, tight memory, 4
    devices idle and five stages of 8.5-12.0 ms, 299.1 -> 294.7 ms for a 10 s plan."""
    b, r, t = list(st.bounds), list(st.replicas), list(st.degrees)
    S = len(r)
    free = ev.cluster.num_devices - st.num_devices
    heavy = sorted((k for k in range(S) if b[k + 1] - b[k] >= 2),
                   key=lambda k: (-ev.table.compute_ms(b[k], b[k + 1]) / (r[k] * t[k]), k))
    chosen: set[int] = set()
    need = 0
    for k in heavy:
        need += r[k] * t[k]
        if need > free:
            break
        chosen.add(k)
        if len(chosen) < 2:
            continue
        nb, nr, nt = [0], [], []
        for j in range(S):
            if j in chosen:
                nb.append(_balanced_split(ev.table, b[j], b[j + 1]))
                nr.append(r[j])
                nt.append(t[j])
            nb.append(b[j + 1])
            nr.append(r[j])
            nt.append(t[j])
        yield st.with_stages(nb, nr, nt)


def transfer_moves(st: Structure, ev: Evaluator) -> Iterator[Structure]:
    """The last tier of the planner's very last descent (`planner.search._polish`): a stage's
    replicas set to another count that changes the microbatches each replica runs (the
    smallest r of each ceil(m / r), two or more away from its count), the devices taken from
    one other stage or given to one. Single transfers are `neighbours`, and counts on free
    devices `wide_moves`; where neither a first transfer nor a second one alone improves, both
    together may (GNMT on 16 x 1 devices at 1 GB/s, tight memory: a stage from 2 to 4
    replicas, the last stage from 3 to 1, 378.3 -> 371.4 ms)."""
    r, t = list(st.replicas), st.degrees
    S = len(r)
    levels = _replica_levels(st, ev)
    for k in range(S):
        for x in levels:
            d = x - r[k]
            if abs(d) < 2:
                continue
            for j in range(S):
                if j == k or t[j] != t[k] or r[j] - d < 1:
                    continue
                nr = r.copy()
                nr[k], nr[j] = x, r[j] - d
                yield st.with_stages(st.bounds, nr)


SPLIT_ONE_SHARE = 0.25  # of the compound moves' work, more, for the last descent (`split_one_moves`)


class Budget:
    """Simulated actions the search may spend, and a wall-clock safety net."""

    def __init__(self, work: int, deadline: float) -> None:
        self.work, self.deadline = work, deadline

    def spent(self, ev: Evaluator) -> bool:
        return ev.work >= self.work or time.perf_counter() >= self.deadline


def descend(start: Structure, ev: Evaluator, table: LayerTable, num_devices: int,
            budget: Budget, wide: bool = False, split_one: bool = False, split_many: bool = False,
            transfer: bool = False) -> tuple[Structure, Score]:
    """Steepest descent from `start` until no move improves or the budget is spent; with
    `split_many`, where no move of `neighbours` improves, the best improving `split_many_moves`
    one (a few moves: tried before the costlier tiers); with `wide`, where none of those
    improves, the best improving `wide_moves` one; with `split_one`, where none of those does,
    the best improving `split_one_moves` one; with `transfer`, where none of those does, the
    best improving `transfer_moves` one (a tier after every other: the descent goes where it
    would without it, and on from where it would stop)."""
    cur, cur_s = start, ev(start)
    while not budget.spent(ev):
        wider = _doubled(cur, ev)  # idle devices: a wider pipeline first, without a full scan
        if wider is not None and ev(wider).better_than(cur_s):
            cur, cur_s = wider, ev(wider)
            continue
        best, best_s = _best_move(neighbours(cur, table, ev), cur_s, ev, budget)
        if best is None and split_many and not budget.spent(ev):
            best, best_s = _best_move(split_many_moves(cur, ev), cur_s, ev, budget)
        if best is None and wide and not budget.spent(ev):
            best, best_s = _best_move(wide_moves(cur, ev), cur_s, ev, budget)
        if best is None and split_one and not budget.spent(ev):
            best, best_s = _best_move(split_one_moves(cur, ev), cur_s, ev, budget)
        if best is None and transfer and not budget.spent(ev):
            best, best_s = _best_move(transfer_moves(cur, ev), cur_s, ev, budget)
        if best is None:
            break
        cur, cur_s = best, best_s
    if cur_s.fits:  # where it ended: a start of the last descents (`planner.search._polish`)
        ev.optima[cur] = cur_s
    return cur, cur_s


def every_tier(table: LayerTable, ev: Evaluator) -> list[Callable[[Structure], Iterator[Structure]]]:
    """The move generators of `descend` with every tier on, in its order."""
    return [lambda st: neighbours(st, table, ev), lambda st: split_many_moves(st, ev),
            lambda st: wide_moves(st, ev), lambda st: split_one_moves(st, ev),
            lambda st: transfer_moves(st, ev)]


def climb(start: Structure, ev: Evaluator, table: LayerTable, budget: Budget) -> tuple[Structure, Score]:
    """First-improvement descent from `start`: the first move that improves is taken (the
    tiers of `descend` with every one of them, in its order, `every_tier`), until none improves
    or the budget is spent. Where a steepest descent spends its work scanning every neighbour of
    each step (hundreds on 16 stages), this moves after a few: from the plan the search ended
    on, a 200-layer chain on 4 x 4 devices with 64 microbatches went from 122.1 to 104.5 ms in
    1,800 evaluations, where the steepest descent's budget had stopped it. From a local optimum
    of every tier it evaluates nothing new (the evaluator keeps every score)."""
    tiers = every_tier(table, ev)
    cur, cur_s = start, ev(start)
    while not budget.spent(ev):
        for tier in tiers:
            nb, nb_s = _first_move(tier(cur), cur_s, ev, budget)
            if nb is not None or budget.spent(ev):
                break
        if nb is None:
            break
        cur, cur_s = nb, nb_s
    return cur, cur_s


def _first_move(moves: Iterator[Structure], score: Score, ev: Evaluator, budget: Budget
                ) -> tuple[Structure | None, Score]:
    """The first of `moves` better than `score` (None if none is), scanned until the budget
    is spent."""
    for nb in moves:
        s = ev(nb)
        if s.better_than(score):
            return nb, s
        if budget.spent(ev):
            break
    return None, score


def _best_move(moves: Iterator[Structure], score: Score, ev: Evaluator, budget: Budget
               ) -> tuple[Structure | None, Score]:
    """The best of `moves` better than `score` (None if none is), scanned until the budget
    is spent."""
    best, best_s = None, score
    for nb in moves:
        s = ev(nb)
        if s.better_than(best_s):
            best, best_s = nb, s
        if budget.spent(ev):
            break
    return best, best_s


def _doubled(st: Structure, ev: Evaluator) -> Structure | None:
    """Every stage's replicas doubled, if the cluster has the devices."""
    if 2 * st.num_devices > ev.cluster.num_devices:
        return None
    return st.with_stages(st.bounds, [2 * x for x in st.replicas])


def kick(st: Structure, rng: random.Random, table: LayerTable, ev: Evaluator,
         moves: int = 3) -> Structure:
    for _ in range(moves):
        options = list(_moves(st, table, ev))
        if not options:
            break
        st = _apply(st, options[rng.randrange(len(options))])
    return st


def iterated_search(starts: list[Structure], ev: Evaluator, table: LayerTable,
                    num_devices: int, budget: Budget, seed: int,
                    visit: Callable[[Structure], None] | None = None,
                    wide_work: int = 0) -> tuple[Structure | None, Score | None]:
    """Descent from every start (best start first), then kicks until the budget is spent: from
    the best plan of each microbatch size in turn (one size: from the best plan), a size
    resting once 200 kicks in a row did not improve it. `visit` sees every local optimum.
    Then, on `wide_work` more, the same from each size's best plan with `wide_moves` as well
    (`_widen`): what the first part found is unchanged, so the plan is never worse for it."""
    rng = random.Random(seed)
    best, best_s = None, None
    bests: dict[int, tuple[Structure, Score]] = {}  # per microbatch size

    def keep(got: Structure, s: Score) -> bool:
        b = got.microbatch_size
        if b in bests and not s.better_than(bests[b][1]):
            return False
        bests[b] = (got, s)
        return True

    order = sorted(set(starts), key=lambda x: (_key(ev(x)), x))
    # several microbatch sizes: first the best start of each size, each descent with an equal
    # share of half the budget (one size's long descent must not starve the others), then the
    # best of those descends on with the rest, then every other start
    firsts: list[Structure] = []
    for st in order:  # already best first
        if all(st.microbatch_size != f.microbatch_size for f in firsts):
            firsts.append(st)
    if len(firsts) < 2:
        firsts = []
    share = budget.work // (2 * max(1, len(firsts)))
    for st in firsts:
        if budget.spent(ev):
            break
        got, s = descend(st, ev, table, num_devices,
                         Budget(min(budget.work, ev.work + share), budget.deadline))
        keep(got, s)  # where its share ended (then the best of them descends on)
        if s.better_than(best_s):
            best, best_s = got, s
    first_set = set(firsts)
    for st in ([best] if best is not None else []) + [x for x in order if x not in first_set]:
        if budget.spent(ev) and best is not None:
            break
        got, s = descend(st, ev, table, num_devices, budget)
        if visit is not None:
            visit(got)
        keep(got, s)
        if s.better_than(best_s):
            best, best_s = got, s
    best, best_s = _kicks(bests, best, best_s, ev, table, num_devices, budget, rng, visit, keep)
    if wide_work > 0 and best is not None:
        best, best_s = _widen(bests, best, best_s, ev, table, num_devices,
                              Budget(ev.work + wide_work, budget.deadline), rng, visit, keep)
        # last, one descent from the best plan with every tier of moves, on work of its own:
        # whatever it finds is an improvement of the plan every earlier step gave
        best, best_s = descend(best, ev, table, num_devices,
                               Budget(ev.work + int(SPLIT_ONE_SHARE * wide_work), budget.deadline),
                               wide=True, split_one=True)
    return best, best_s


def _kicks(bests: dict[int, tuple[Structure, Score]], best: Structure | None,
           best_s: Score | None, ev: Evaluator, table: LayerTable, num_devices: int,
           budget: Budget, rng: random.Random, visit: Callable[[Structure], None] | None,
           keep: Callable[[Structure, Score], bool], wide: bool = False
           ) -> tuple[Structure | None, Score | None]:
    """Kicks and descents until the budget is spent, the microbatch sizes taking turns."""
    stall: dict[int, int] = {}
    turn = 0
    while best is not None and not budget.spent(ev):
        sizes = [b for b in sorted(bests) if stall.get(b, 0) < 200]
        if not sizes:
            break
        b = sizes[turn % len(sizes)]
        turn += 1
        got, s = descend(kick(bests[b][0], rng, table, ev), ev, table, num_devices, budget, wide)
        if visit is not None:
            visit(got)
        improved = keep(got, s)
        if improved:
            stall[got.microbatch_size] = 0
        if not (improved and got.microbatch_size == b):
            stall[b] = stall.get(b, 0) + 1
        if s.better_than(best_s):
            best, best_s = got, s
    return best, best_s


def _widen(bests: dict[int, tuple[Structure, Score]], best: Structure, best_s: Score,
           ev: Evaluator, table: LayerTable, num_devices: int, budget: Budget,
           rng: random.Random, visit: Callable[[Structure], None] | None,
           keep: Callable[[Structure, Score], bool]) -> tuple[Structure, Score]:
    """Each size's best plan descends once more with `wide_moves`, then kicks do (the plateaus
    where one move changes nothing and two do: a merge that frees a device another stage
    needs, a stage's replicas from 4 to 8, two boundaries moved together)."""
    for b in sorted(bests):
        if budget.spent(ev):
            break
        got, s = descend(bests[b][0], ev, table, num_devices, budget, wide=True)
        if visit is not None:
            visit(got)
        keep(got, s)
        if s.better_than(best_s):
            best, best_s = got, s
    got, s = _kicks(bests, best, best_s, ev, table, num_devices, budget, rng, visit, keep,
                    wide=True)
    assert got is not None and s is not None  # it starts from `best`, which is not None
    return got, s


def _key(s: Score) -> tuple[float, float, int, int]:
    return (s.overshoot, s.objective_ms, s.devices, s.stages)
