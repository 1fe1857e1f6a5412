"""Calibrate's pipeline probe (`runtime.pipeline_probe`): the per-message overhead it fits
against a hand-computed pipeline, and what it writes into cluster.json. The real run over gloo
is in test_calibrate.py."""

from __future__ import annotations

import pytest

from planner.formats import Cluster
from runtime.calibrate import cluster_from, format_summary
from runtime.pipeline_probe import chain_schedule, fit_overhead, simulated_ms


def test_one_microbatch_is_the_sum_of_its_path():
    """One microbatch through two ranks: F0, a message, F1, B1, a message back, B0. Each message
    takes latency + bytes / bandwidth + the overhead, so the overhead is what the measured time
    leaves of that path, halved."""
    fwd, bwd, nbytes, lat_us, gbps = (1.0, 2.0), (3.0, 4.0), 1e6, 100.0, 2.0
    wire_ms = lat_us / 1e3 + nbytes / (gbps * 1e9) * 1e3
    measured = 10.0 + 2 * (wire_ms + 0.75)
    assert simulated_ms(fwd, bwd, 1, nbytes, [(lat_us, gbps)], 750.0) == pytest.approx(measured)
    assert fit_overhead(fwd, bwd, 1, nbytes, [(lat_us, gbps)], measured) == pytest.approx(750.0, abs=1e-3)


@pytest.mark.parametrize("world", [2, 4])
def test_fit_recovers_the_overhead_of_a_longer_pipeline(world):
    fwd = [0.6 + 0.05 * r for r in range(world)]
    bwd = [1.1 - 0.05 * r for r in range(world)]
    hops = [(130.0, 3.5)] * (world - 1)
    for true_us in (80.0, 1000.0):
        measured = simulated_ms(fwd, bwd, 8, 32768, hops, true_us)
        assert fit_overhead(fwd, bwd, 8, 32768, hops, measured) == pytest.approx(true_us, abs=0.01)
    # a run faster than even no overhead simulates: 0, never negative
    fastest = simulated_ms(fwd, bwd, 8, 32768, hops, 0.0)
    assert fit_overhead(fwd, bwd, 8, 32768, hops, 0.9 * fastest) == 0.0
    # one rank sends nothing
    assert fit_overhead([1.0], [2.0], 8, 32768, [], 50.0) == 0.0


@pytest.mark.parametrize("world", range(2, 10))
def test_the_probe_chain_cannot_deadlock_on_nccl(world):
    """The probe's 1F1B chain, issued as the executor issues it, passes the static order check
    every plan passes on NCCL (more ranks than microbatches included)."""
    from planner.p2p_order import check_schedule

    check_schedule(chain_schedule(world, 8), [(r,) for r in range(world)])


def _meas(pipeline):
    link = {"latency_us": 120.0, "gb_per_s": 3.0}
    return {"ranks_of_node": [[0, 1]], "speeds": [1.0, 1.0], "memory_bytes": [8e9, 8e9],
            "links": {"intra": link}, "allreduce": {"efficiency": 0.5}, "node_names": ["n0"],
            "backend": "gloo", "device": "cpu", "device_name": "cpu", "pipeline": pipeline}


def test_cluster_json_carries_the_overhead():
    probe = {"p2p_overhead_us": 812.34, "iteration_ms": 25.0, "fwd_ms": [0.6, 0.6], "schedule": "1f1b",
             "microbatches": 8, "simulated_without_overhead_ms": 17.5}
    c = Cluster.model_validate(cluster_from(_meas(probe)))
    assert c.p2p_overhead_us == 812.3 and c.calibration["pipeline"]["iteration_ms"] == 25.0
    summary = format_summary(c.model_dump(exclude_none=True), None)
    assert "per-message overhead (us)" in summary and "812.3" in summary and "17.50 ms simulated" in summary
    # one rank: no probe, no overhead (as before the probe)
    assert Cluster.model_validate(cluster_from(_meas(None))).p2p_overhead_us == 0.0
