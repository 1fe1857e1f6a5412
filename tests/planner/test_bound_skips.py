"""The tensors a stage surely receives from each layer before it (`bound.skip_arrivals`): a
residual block cut inside sends its input on to the add, and the stage's first forward waits
for it. Checked by hand on one block, then plan by plan against `evaluate()` on residual
models (a condition the simulator does not meet would make the bound wrong)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.build import evaluate
from planner.cost import layer_table
from planner.formats import INPUT_NODE, Cluster, PlanOptions, Profile
from planner.importers.pipedream import import_pipedream_file
from planner.partition import Candidate
from planner.search.bound import (
    conditions,
    feasible,
    hop_bytes,
    restrict,
    skip_arrivals,
    tighten,
    without_classes,
)
from tests.planner.helpers import chain_profile
from tests.planner.test_bound_conditions import REL, _neighbour, _random_plan, residual_profile


def _block() -> Profile:
    """l0 -> l1 -> l2 -> l3, and l3 (the add) reads l0's output too: 400 MB against 1 MB."""
    layers = [dict(name=f"l{i}", fwd_ms=1.0, bwd_ms=2.0, param_bytes=1000, activation_bytes=1000,
                   output_bytes=1) for i in range(4)]
    edges = [dict(src=INPUT_NODE, dst="l0", bytes=10),
             dict(src="l0", dst="l1", bytes=10**6), dict(src="l1", dst="l2", bytes=10**6),
             dict(src="l2", dst="l3", bytes=10**6), dict(src="l0", dst="l3", bytes=4 * 10**8, tensor="skip")]
    return Profile(model=dict(path="block", sha256="0"), device=dict(type="cpu", name="x"), batch_size=4,
                   layers=layers, edges=edges)


def test_a_block_cut_inside_waits_for_its_input() -> None:
    table = layer_table(_block())
    HF = np.array(table.fwd_prefix_ms, dtype=float)
    HB = np.array(table.bwd_prefix_ms, dtype=float)

    def ms(b: np.ndarray) -> np.ndarray:  # 1 GB/s, no latency
        return b / 1e9 * 1e3

    got = skip_arrivals(table, 1.0, HF, np.r_[HB[1:], HB[-1]], ms)
    assert got is not None
    arrive, leave = got
    # a stage of the add alone reads the block's input: after l0's forward, 400 ms on
    assert arrive[3, 4] == pytest.approx(1.0 + 400.0)
    assert leave[3, 4] == pytest.approx(400.0 + 2.0)  # and its gradient goes back before l0's backward
    assert arrive[2, 3] == pytest.approx(2.0 + 1.0)  # layer 2 alone: l1's output only
    assert arrive[2, 4] == pytest.approx(1.0 + 400.0)  # with the add
    # from layer 1: one message from l0 with both tensors where the stage holds the add
    assert arrive[1, 2] == pytest.approx(1.0 + 1.0) and arrive[1, 4] == pytest.approx(1.0 + 401.0)
    assert arrive[0].max() == 0.0 and leave[0].max() == 0.0  # the first stage receives nothing


def test_a_chain_has_no_skips() -> None:
    table = layer_table(chain_profile([1.0] * 6))
    HF = np.array(table.fwd_prefix_ms, dtype=float)
    assert skip_arrivals(table, 1.0, HF, HF, lambda b: b) is None


def _least(c, hi: float) -> float:
    lo = 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(c, mid) else (mid, hi)
    return hi


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_residual_plans_meet_the_skip_arrivals(schedule: str) -> None:
    """Residual models (6-10 layers) on 8 devices at slow links: random walks over their plans,
    each plan's time checked against the cross-stage DP with the skip arrivals restricted to
    its cuts (feasible there, or the bound would be wrong); and the DP's least time, with and
    without them, higher on some."""
    checked = tighter = 0
    for seed in range(16):
        rng = random.Random(seed)
        table = layer_table(residual_profile(rng, rng.randint(6, 10)))
        nodes, per = rng.choice([(8, 1), (4, 2)])  # the skips' links: slow where a node has one device
        cluster = Cluster(nodes=nodes, devices_per_node=per, device_memory_gb=80,
                          intra_node_gb_per_s=rng.choice([1, 10]), inter_node_gb_per_s=rng.choice([0.5, 1]),
                          latency_us=0)
        mb = rng.choice([2, 4])
        m = 32 // mb
        options = PlanOptions(global_batch=32, microbatch_size=mb, optimizer="sgd", schedule=schedule)
        L, D = table.num_layers, cluster.num_devices
        c = replace(conditions(table, cluster, "sgd", schedule, 32, mb, hop_bytes(table), (1,), False),
                    cross_stage=True)
        before = replace(c, skip_in=None, skip_out=None)
        tighter += _least(c, 1e6) > _least(before, 1e6) * 1.001
        c = replace(c, prefix_hops=rng.random() < 0.5, microbatch_paths=rng.random() < 0.5)
        cand = _random_plan(rng, L, D, m, mb)
        for step in range(12):
            nxt = _neighbour(rng, cand, L, D, m) if step else cand
            if nxt is None:
                continue
            cand = Candidate(tuple(replace(s, recompute=False) for s in nxt.stages), mb, m)
            ev = evaluate(table, cluster, cand, options)
            if not ev.fits:
                continue
            cuts = np.array([0, *[s.stop for s in cand.stages]])
            T = ev.iteration_ms
            assert feasible(restrict(c, cuts), T * (1 + REL)), (
                f"seed {seed}: {[(s.start, s.stop, s.replicas) for s in cand.stages]} takes {T} ms, "
                "the DP with the skip arrivals says none can")
            checked += 1
    assert checked >= 100 and tighter >= 3, (checked, tighter)


RESNET101 = Path(__file__).resolve().parents[3] / "shared" / "data" / "pipedream-profiles" / "resnet101.txt"


@pytest.mark.skipif(not RESNET101.exists(), reason="needs ../shared/data/pipedream-profiles")
def test_the_probe_below_the_plan_keeps_the_hop_classes() -> None:
    """ResNet-101 on 16 devices at 1 GB/s: data parallelism alone, 745.21 ms, is the plan.
    Where the budget affords the DP without hop classes only a few steps, the probe 1 % below
    the plan with them proves the 1 % (without them, a plan cut inside a residual block whose
    input the hop leaves out meets the conditions there)."""
    profile = import_pipedream_file(RESNET101, 128)
    table = layer_table(profile)
    cluster = Cluster(nodes=16, devices_per_node=1, intra_node_gb_per_s=1, inter_node_gb_per_s=1,
                      device_memory_gb=80)
    c = conditions(table, cluster, "sgd", "1f1b", 16 * 128, 128, hop_bytes(table))
    plan = 745.2107
    flat = without_classes(c)
    budget = 420_000
    without, _ = tighten(flat, 411.0, plan, budget, upper_feasible=True, per_microbatch=False)
    got, spent = tighten(flat, 411.0, plan, budget, upper_feasible=True, per_microbatch=False, classed=c)
    assert spent <= budget
    assert without < plan * 0.99 <= got <= plan
