import json

from planner.schedules import generate
from planner.simulator import Event, simulate
from planner.trace import chrome_trace, merge_traces, text_timeline
from tests.planner.helpers import equal_costs


def test_chrome_trace_has_one_track_per_rank_and_complete_events() -> None:
    costs = equal_costs(3, 4, 1.0, 2.0)
    sim = simulate(costs, generate("1f1b", costs.stage_devices, 4))
    trace = json.loads(json.dumps(chrome_trace(sim, {"model": "x"})))
    evs = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    assert names == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 1)", 2: "rank 2 (stage 2)"}
    work = [e for e in evs if e["ph"] == "X"]
    assert len(work) == 3 * 4 * 2
    for e in work:
        assert e["dur"] > 0 and e["ts"] >= 0 and e["cat"] in ("F", "B")
    last = max(e["ts"] + e["dur"] for e in work)
    assert last / 1e3 == sim.iteration_ms
    assert trace["metadata"] == {"model": "x"}


def test_measured_events_render_and_merge_side_by_side() -> None:
    measured = [Event(0, "0F0", "F", 0, 0, 0.0, 1.5), Event(0, "0B0", "B", 0, 0, 1.5, 4.0)]
    pred = chrome_trace(measured, label="predicted", pid=0)
    meas = chrome_trace(measured, label="measured", pid=1)
    both = merge_traces(pred, meas)
    procs = [e["args"]["name"] for e in both["traceEvents"] if e["name"] == "process_name"]
    assert procs == ["predicted", "measured"]


def test_text_timeline_shows_every_rank() -> None:
    costs = equal_costs(2, 2, 1.0, 1.0)
    sim = simulate(costs, generate("gpipe", costs.stage_devices, 2))
    text = text_timeline(sim, width=30)
    rows = [line for line in text.splitlines() if line.startswith("rank")]
    assert len(rows) == 2
    assert rows[1].split("|")[1].startswith("." * 5)  # stage 1 waits for stage 0's first forward
    assert "0" in rows[0] and "a" in rows[0]
