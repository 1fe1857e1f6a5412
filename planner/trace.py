"""Timelines for people: Chrome trace JSON (one track per rank; opens in Perfetto and
chrome://tracing) and a compact text timeline for small plans.

Both take plain `Event` records, so a measured run (the runtime records the same events) and a
prediction render the same way; `merge_traces` puts several side by side in one file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from planner.simulator import Event, Simulation

EventsLike = Simulation | Iterable[Event]


def _events(x: EventsLike) -> list[Event]:
    return list(x.events if isinstance(x, Simulation) else x)


# Chrome's reserved colour names (catapult's color_scheme): forward, input gradient, weight
# gradient, all-reduce and optimizer step each their own
COLOURS = {"F": "thread_state_running", "B": "rail_response", "W": "good",
           "allreduce": "thread_state_iowait", "optimizer": "yellow"}


def chrome_trace(events: EventsLike, metadata: Mapping[str, Any] | None = None,
                 label: str = "predicted", pid: int = 0,
                 stage_of_rank: Mapping[int, int] | None = None) -> dict[str, Any]:
    """Chrome trace event format: complete events ("ph": "X", microseconds), one thread per
    rank named `rank r (stage s)`, one process named `label`; `metadata` goes under "metadata"."""
    evs = _events(events)
    if stage_of_rank is None:
        stage_of_rank = events.stage_of_rank if isinstance(events, Simulation) else {}
        if not stage_of_rank:
            stage_of_rank = {e.rank: e.stage for e in evs}
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}},
    ]
    for r in sorted({e.rank for e in evs} | set(stage_of_rank)):
        stage = stage_of_rank.get(r)
        name = f"rank {r}" + (f" (stage {stage})" if stage is not None else "")
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r, "args": {"name": name}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": r,
                    "args": {"sort_index": r}})
    for e in evs:
        out.append({
            "ph": "X", "name": e.name, "cat": e.kind, "pid": pid, "tid": e.rank,
            "ts": e.start_ms * 1e3, "dur": max(e.end_ms - e.start_ms, 0.0) * 1e3,
            "args": {"stage": e.stage, "microbatch": e.mb},
            **({"cname": COLOURS[e.kind]} if e.kind in COLOURS else {}),
        })
    return {"traceEvents": out, "displayTimeUnit": "ms", "metadata": dict(metadata or {})}


def merge_traces(*traces: dict[str, Any]) -> dict[str, Any]:
    """Several traces in one file (give each its own `pid` and `label` when making them)."""
    merged: dict[str, Any] = {"traceEvents": [], "displayTimeUnit": "ms", "metadata": {}}
    for t in traces:
        merged["traceEvents"].extend(t["traceEvents"])
        merged["metadata"].update(t.get("metadata", {}))
    return merged


def text_timeline(events: EventsLike, width: int = 100, max_ranks: int = 32) -> str:
    """One line per rank, time left to right in `width` columns. Forward of microbatch j is the
    digit j mod 10, backward the letter 'a' + j mod 26, all-reduce '=', optimizer step '#',
    idle '.'."""
    evs = _events(events)
    if not evs:
        return "(no events)"
    end = max(e.end_ms for e in evs)
    scale = width / end if end > 0 else 0.0
    ranks = sorted({e.rank for e in evs})
    lines = [f"0 ms {'-' * max(width - 14, 1)} {end:.1f} ms".rjust(width + 10)]
    for r in ranks[:max_ranks]:
        row = ["."] * width
        for e in evs:
            if e.rank != r:
                continue
            if e.kind == "tp":  # inside its forward/backward: drawn there
                continue
            ch = "=" if e.kind == "allreduce" else "#" if e.kind == "optimizer" else (
                str(e.mb % 10) if e.kind == "F" else chr(ord("a") + e.mb % 26) if e.kind == "B"
                else chr(ord("A") + e.mb % 26))
            a = min(int(e.start_ms * scale), width - 1)
            z = max(min(int(round(e.end_ms * scale)), width), a + 1)
            for c in range(a, z):
                row[c] = ch
        lines.append(f"rank {r:4d} |{''.join(row)}|")
    if len(ranks) > max_ranks:
        lines.append(f"... {len(ranks) - max_ranks} more ranks")
    legend = "legend: 0-9 forward of microbatch j (mod 10), a-z its backward"
    if any(e.kind == "W" for e in evs):
        legend += " (input gradient), A-Z its weight gradient"
    lines.append(legend + ", = all-reduce" + (", # optimizer step" if any(e.kind == "optimizer" for e in evs)
                                               else "") + ", . idle")
    return "\n".join(lines)
