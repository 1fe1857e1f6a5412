import pytest

from planner.schedules import generate
from planner.simulator import simulate
from planner.validate import validate
from tests.planner.helpers import equal_costs


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("S", "m"), [(1, 1), (1, 5), (2, 1), (3, 8), (4, 4), (4, 2), (5, 12)])
def test_equal_stages_free_comm_closed_form(schedule: str, S: int, m: int) -> None:
    F, B = 1.5, 2.5
    costs = equal_costs(S, m, F, B)
    sim = simulate(costs, generate(schedule, costs.stage_devices, m))
    assert sim.iteration_ms == pytest.approx((m + S - 1) * (F + B))
    assert sim.bubble_fraction == pytest.approx((S - 1) / (m + S - 1))
    for busy in sim.busy_ms.values():
        assert busy == pytest.approx(m * (F + B))


@pytest.mark.parametrize(("S", "m"), [(1, 3), (3, 8), (4, 2), (6, 6)])
def test_peak_inflight_closed_form(S: int, m: int) -> None:
    costs = equal_costs(S, m, act_bytes=10.0)
    one = simulate(costs, generate("1f1b", costs.stage_devices, m))
    gp = simulate(costs, generate("gpipe", costs.stage_devices, m))
    for s in range(S):
        assert one.peak_inflight[s] == min(m, S - s)
        assert gp.peak_inflight[s] == m
        assert one.peak_memory_bytes[s] == 100.0 + 10.0 * min(m, S - s)


def test_replicated_stages_split_microbatches_and_all_reduce() -> None:
    costs = equal_costs(2, 8, 1.0, 2.0, replicas=2)
    costs = type(costs)(**{**costs.__dict__, "allreduce_ms": (5.0, 7.0)})
    sched = generate("1f1b", costs.stage_devices, 8)
    assert [a.mb for a in sched[1] if a.kind == "F"] == [1, 3, 5, 7]
    validate(sched, 2, 8)
    sim = simulate(costs, sched)
    # each replica pair runs a 2-stage pipeline of 4 microbatches: stage 0 ends at (4+1)*3 = 15,
    # stage 1 two ms earlier; then the all-reduces (5 and 7 ms)
    assert sim.iteration_ms == pytest.approx(max(15.0 + 5.0, 13.0 + 7.0))
    ar = [e for e in sim.events if e.kind == "allreduce"]
    assert sorted(e.rank for e in ar) == [0, 1, 2, 3]
    last_b = {s: max(e.end_ms for e in sim.events if e.kind == "B" and e.stage == s) for s in (0, 1)}
    for e in ar:
        assert e.start_ms == pytest.approx(last_b[e.stage])
    assert sim.iteration_ms == pytest.approx(max(e.end_ms for e in ar))


def test_transfer_delays_consumer() -> None:
    costs = equal_costs(2, 1, 1.0, 2.0, send_ms=0.5)
    sim = simulate(costs, generate("1f1b", costs.stage_devices, 1))
    # F0 [0,1], transfer, F1 [1.5,2.5], B1 [2.5,4.5], transfer, B0 [5,7]
    assert sim.iteration_ms == pytest.approx(7.0)


def test_large_plan_simulates() -> None:
    costs = equal_costs(64, 256, replicas=16)
    sched = generate("1f1b", costs.stage_devices, 256)
    sim = simulate(costs, sched)
    assert len(sim.busy_ms) == 1024
    per_replica = 256 // 16
    assert sim.iteration_ms == pytest.approx((per_replica + 64 - 1) * 3.0, rel=0.5)


def test_simulating_an_impossible_schedule_raises_the_grid() -> None:
    from planner.actions import parse_actions
    from planner.validate import ScheduleError

    costs = equal_costs(2, 2)
    sched = {0: parse_actions(["0F0", "0B0", "0F1", "0B1"]), 1: parse_actions(["1F0", "1F1", "1B0", "1B1"])}
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(costs, sched)


def test_mixed_hardware_uses_the_slowest_device_and_all_speeds_for_the_bound() -> None:
    from planner.formats import Cluster, PlanOptions
    from planner.solve import make_plan
    from tests.planner.helpers import chain_profile

    c = Cluster.model_validate({
        "nodes": [{"name": "fast", "devices": 1, "device_memory_gb": 80, "speed": 2.0},
                  {"name": "slow", "devices": 2, "device_memory_gb": 40, "speed": 0.5}],
        "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10})
    p = chain_profile([1.0, 1.0, 2.0, 2.0], batch_size=4)
    plan = make_plan(p, c, PlanOptions(global_batch=8, microbatch_size=4, method="manual",
                                       split=[2, 2], replicas=[1, 2]))
    assert plan.stages[0].predicted.fwd_ms == pytest.approx(2.0 / 2.0)
    assert plan.stages[1].predicted.fwd_ms == pytest.approx(4.0 / 0.5)
    assert plan.stages[1].predicted.memory_limit_bytes == 40 * 10**9
    assert plan.predicted.lower_bound_ms == pytest.approx(2 * 18.0 / 3.0)


def test_schedules_written_as_strings() -> None:
    costs = equal_costs(2, 2, 1.0, 2.0)
    sim = simulate(costs, {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]})
    assert sim.iteration_ms == pytest.approx((2 + 2 - 1) * 3.0)
