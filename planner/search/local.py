"""Deterministic local search over structures, every move scored by `evaluate()`.

Moves: shift a stage boundary by 1, 2, 4, ... layers; merge two adjacent stages; split a stage
at its balanced point (and one layer either side); move a replica from one stage to another;
add or drop a replica; change the placement policy. Steepest descent to a local optimum, then
iterated kicks (a few random moves from a seeded generator) and descent again, for as long as
the budget of simulated actions lasts. The budget, not the clock, ends the search, so the same
input gives the same plan on an idle or a loaded machine; the wall-clock deadline is only a
safety net.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

from planner.cost import LayerTable
from planner.search.space import Evaluator, Score, Structure


def _with(st: Structure, bounds: list[int], reps: list[int]) -> Structure:
    return Structure(st.microbatch_size, tuple(bounds), tuple(reps), st.policy)


def _balanced_split(table: LayerTable, a: int, z: int) -> int:
    """The layer index in (a, z) that halves the stage's compute most evenly."""
    total = table.compute_ms(a, z)
    best, best_d = a + 1, float("inf")
    for k in range(a + 1, z):
        d = abs(2 * table.compute_ms(a, k) - total)
        if d < best_d:
            best, best_d = k, d
    return best


def neighbours(st: Structure, table: LayerTable, num_devices: int, num_policies: int
               ) -> Iterator[Structure]:
    b, r = list(st.bounds), list(st.replicas)
    S, used = len(r), sum(r)
    free = num_devices - used
    # boundary shifts
    for k in range(1, S):
        for step in (1, 2, 4, 8, 16, 32):
            for sign in (-1, 1):
                p = b[k] + sign * step
                if b[k - 1] < p < b[k + 1]:
                    nb = b.copy()
                    nb[k] = p
                    yield _with(st, nb, r)
    # merges (replicas: the larger of the two, or both)
    for k in range(S - 1):
        nb = b[: k + 1] + b[k + 2:]
        for rep in sorted({max(r[k], r[k + 1]), r[k] + r[k + 1]}):
            yield _with(st, nb, r[:k] + [rep] + r[k + 2:])
    # splits
    for k in range(S):
        a, z = b[k], b[k + 1]
        if z - a < 2:
            continue
        mid = _balanced_split(table, a, z)
        for p in sorted({mid - 1, mid, mid + 1}):
            if not a < p < z:
                continue
            nb = b[: k + 1] + [p] + b[k + 1:]
            if r[k] >= 2:
                h = r[k] // 2
                yield _with(st, nb, r[:k] + [r[k] - h, h] + r[k + 1:])
            if free >= r[k]:
                yield _with(st, nb, r[:k] + [r[k], r[k]] + r[k + 1:])
            elif free >= 1:
                yield _with(st, nb, r[:k] + [r[k], 1] + r[k + 1:])
    # replicas
    for k in range(S):
        if free >= 1:
            yield _with(st, b, r[:k] + [r[k] + 1] + r[k + 1:])
        if r[k] >= 2:
            yield _with(st, b, r[:k] + [r[k] - 1] + r[k + 1:])
            for t in range(S):
                if t != k:
                    nr = r.copy()
                    nr[k] -= 1
                    nr[t] += 1
                    yield _with(st, b, nr)
    for p in range(num_policies):
        if p != st.policy:
            yield Structure(st.microbatch_size, st.bounds, st.replicas, p)


class Budget:
    """Simulated actions the search may spend, and a wall-clock safety net."""

    def __init__(self, work: int, deadline: float) -> None:
        self.work, self.deadline = work, deadline

    def spent(self, ev: Evaluator) -> bool:
        return ev.work >= self.work or time.perf_counter() >= self.deadline


def descend(start: Structure, ev: Evaluator, table: LayerTable, num_devices: int,
            budget: Budget) -> tuple[Structure, Score]:
    """Steepest descent from `start` until no move improves or the budget is spent."""
    cur, cur_s = start, ev(start)
    while not budget.spent(ev):
        best, best_s = None, cur_s
        for nb in neighbours(cur, table, num_devices, len(ev.policies)):
            s = ev(nb)
            if s.better_than(best_s):
                best, best_s = nb, s
            if budget.spent(ev):
                break
        if best is None:
            break
        cur, cur_s = best, best_s
    return cur, cur_s


def kick(st: Structure, rng: random.Random, table: LayerTable, num_devices: int,
         num_policies: int, moves: int = 3) -> Structure:
    for _ in range(moves):
        options = list(neighbours(st, table, num_devices, num_policies))
        if not options:
            break
        st = options[rng.randrange(len(options))]
    return st


def iterated_search(starts: list[Structure], ev: Evaluator, table: LayerTable,
                    num_devices: int, budget: Budget, seed: int,
                    visit: Callable[[Structure], None] | None = None
                    ) -> tuple[Structure | None, Score | None]:
    """Descent from every start (best start first), then kicks from the best found until the
    budget is spent. `visit` sees every local optimum."""
    rng = random.Random(seed)
    best, best_s = None, None
    for st in sorted(set(starts), key=lambda x: (_key(ev(x)), x)):
        if budget.spent(ev) and best is not None:
            break
        got, s = descend(st, ev, table, num_devices, budget)
        if visit is not None:
            visit(got)
        if s.better_than(best_s):
            best, best_s = got, s
    stall = 0
    while best is not None and not budget.spent(ev) and stall < 200:
        got, s = descend(kick(best, rng, table, num_devices, len(ev.policies)), ev, table,
                         num_devices, budget)
        if visit is not None:
            visit(got)
        if s.better_than(best_s):
            best, best_s, stall = got, s, 0
        else:
            stall += 1
    return best, best_s


def _key(s: Score) -> tuple[float, float, int, int]:
    return (s.overshoot, s.objective_ms, s.devices, s.stages)
