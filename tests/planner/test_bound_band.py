"""`planner.search.bound.memory_band`: the DPs look only at stages whose memory can fit (one
microbatch in flight). It must change nothing but the work: the suffix DP's tables, its plan
and the prefix DP's hop sums are the same to the last bit as with every stage looked at, on
instances where memory binds (chains and DAGs, recomputed variants, each schedule, the
cross-stage conditions with the microbatch paths and per-microbatch tracking)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from planner.cost import layer_table
from planner.search import bound
from planner.search.bound import (
    _prefix_hops,
    _suffix_dp,
    band_cells,
    conditions,
    dp_work,
    hop_bytes,
    lower_bound,
    memory_band,
    plan_at,
)
from tests.planner.test_search import random_cluster, random_profile


def _stage_need(c: bound.Conditions, i: int, j: int) -> float:
    """The least memory any variant's stage [i, j) needs, one microbatch in flight (as the
    DP's memory test counts it)."""
    out = np.inf
    for v in c.variants:
        params = v.Pp[j] - v.Pp[i]
        if v.recompute:
            need = params * c.static_coef + c.layer_act[i:j].max() + c.kept_lo[j] - c.kept_lo[i]
        else:
            need = params * c.static_coef + v.Ap[j] - v.Ap[i]
        out = min(out, need)
    return out


def _binding(rng: random.Random) -> bound.Conditions:
    """Conditions of a random instance with a memory limit between its smallest and its
    largest stage's need: some stages fit, others do not."""
    while True:
        profile = random_profile(rng, rng.randint(5, 9), dag=rng.random() < 0.5)
        cluster = random_cluster(rng, mixed=False, max_nodes=2)
        table = layer_table(profile)
        c = conditions(table, cluster, rng.choice(["sgd", "adam"]), rng.choice(["1f1b", "gpipe", "zb-h1"]),
                       16, 2, hop_bytes(table), recompute=rng.random() < 0.6)
        needs = sorted(_stage_need(c, i, j) for i in range(c.L) for j in range(i + 1, c.L + 1))
        if needs[0] < needs[-1]:
            return replace(c, memory_bytes=rng.uniform(needs[len(needs) // 4], needs[3 * len(needs) // 4]))


def test_the_band_holds_every_stage_that_fits_and_no_more() -> None:
    """Against the stage's memory computed on its own, per (i, j)."""
    rng = random.Random(7)
    for _ in range(20):
        c = _binding(rng)
        band = memory_band(c)
        assert np.all(np.diff(band) >= 0)
        for i in range(c.L):
            for j in range(i + 1, c.L + 1):
                fits = _stage_need(c, i, j) <= c.memory_bytes
                assert not fits or j <= band[i], (i, j, band)
                assert fits or j > band[i] or any(
                    _stage_need(c, k, j) <= c.memory_bytes for k in range(i + 1, j)), (i, j, band)


@pytest.mark.parametrize("seed", range(12))
def test_the_band_changes_no_table_of_the_dps(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(1000 + seed)
    c = _binding(rng)
    c = replace(c, cross_stage=rng.random() < 0.7, microbatch_paths=rng.random() < 0.5,
                per_microbatch=rng.random() < 0.3)
    assert band_cells(c) < c.L * (c.L + 1) // 2 or seed % 4, "memory should bind on most seeds"
    first, _ = lower_bound(replace(c, cross_stage=False), upper_ms=float("inf"))
    times = [1e9] if first is None else [first.bound_ms * f for f in (0.97, 1.0, 1.05, 1.3, 3.0)]
    banded = []
    for T in times:
        with np.errstate(invalid="ignore"):
            g, choice = _suffix_dp(c, T, want_plan=True)
        banded.append((g, choice, _prefix_hops(c, T), plan_at(c, T)))
    work = dp_work(c)
    monkeypatch.setattr(bound, "memory_band", lambda cc: np.full(cc.L, cc.L))
    assert dp_work(c) >= work
    for T, (g, choice, X, plan) in zip(times, banded, strict=True):
        with np.errstate(invalid="ignore"):
            g0, choice0 = _suffix_dp(c, T, want_plan=True)
        assert np.array_equal(g, g0)  # the same to the last bit (inf included)
        assert choice == choice0
        assert np.array_equal(X, _prefix_hops(c, T))
        assert plan == plan_at(c, T)
