"""`bound.prove` tests 1 % below the plan with the microbatches it tracks, a few first
(`proof_sets`). Each set holds the conditions of the sets before it, so where the work affords
a larger set alone but not after a smaller one, it tests the larger one: it proves whatever
the smaller would."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.cost import layer_table
from planner.search import bound
from planner.search.bound import (
    conditions,
    hop_bytes,
    proof_conditions,
    proof_sets,
    tighten_step_work,
)
from tests.planner.helpers import chain_profile
from tests.planner.helpers import cluster as make_cluster


def _conditions():
    table = layer_table(chain_profile([1.0, 2.0, 1.5, 0.5, 1.0, 2.5, 1.0, 0.8], batch_size=2))
    cl = make_cluster(2, 8)
    c = conditions(table, cl, "sgd", "1f1b", 32, 2, hop_bytes(table))
    cz = proof_conditions(c)
    assert cz.per_microbatch and cz.m == 16
    return c, [tighten_step_work(replace(cz, tracked=t)) for t in proof_sets(cz.m)]


@pytest.mark.parametrize("case", ["all", "four_and_all", "four", "none"])
def test_prove_tests_the_largest_set_the_work_affords(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    c, (one, four, every) = _conditions()
    assert one < four < every
    work, want = {
        "all": (one + four + every, [(15,), (3, 7, 11, 15), ()]),  # cheapest first, each afforded
        # after the last microbatch alone, all are still afforded; after the four, not
        "four_and_all": (four + every, [(15,), ()]),
        "four": (four + one // 2, [(3, 7, 11, 15)]),
        "none": (one - 1, []),
    }[case]
    tested: list[tuple[int, ...]] = []

    def feasible(cz, T):  # every set feasible: record which were tested
        tested.append(cz.tracked)
        return True

    monkeypatch.setattr(bound, "feasible", feasible)
    proven, spent = bound.prove(c, 1.0, work)
    assert not proven and tested == want and spent <= work


def test_prove_stops_at_the_first_set_that_proves(monkeypatch: pytest.MonkeyPatch) -> None:
    c, (one, four, every) = _conditions()
    tested: list[tuple[int, ...]] = []

    def feasible(cz, T):  # the four prove it (infeasible), the last microbatch alone does not
        tested.append(cz.tracked)
        return len(cz.tracked) == 1

    monkeypatch.setattr(bound, "feasible", feasible)
    assert bound.prove(c, 1.0, one + four + every) == (True, one + four)
    tested.clear()
    assert bound.prove(c, 1.0, four + one // 2) == (True, four)  # before: (False, one)
    assert tested == [(3, 7, 11, 15)]
