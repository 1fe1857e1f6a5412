"""Gantt chart of a plan's simulated schedule, drawn with matplotlib (Agg, no display): one row
per rank, forward and backward (and all-reduce) coloured, and the rest of each row shaded as
idle so the pipeline bubbles are visible. Also the Chrome trace of the same simulation."""

from __future__ import annotations

import io
import threading
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402 - after choosing the backend
from matplotlib.patches import Patch  # noqa: E402

from planner.formats import Plan  # noqa: E402
from planner.simulator import Simulation, simulate  # noqa: E402

COLORS = {"F": "#4c72b0", "B": "#dd8452", "allreduce": "#55a868"}
LABELS = {"F": "forward", "B": "backward", "allreduce": "all-reduce"}
IDLE = "#f4cccc"
MAX_LABELLED_EVENTS = 600  # write microbatch numbers on the bars below this many events

_lock = threading.Lock()  # matplotlib's text and font caches are not thread-safe


class TooLarge(ValueError):
    """The schedule has more events than a picture can show."""


def estimated_events(plan: Plan) -> int:
    """Events a simulation of `plan` produces: a forward and a backward per microbatch per stage,
    one all-reduce per replica of a replicated stage (known before simulating)."""
    return 2 * plan.num_microbatches * len(plan.stages) + sum(
        s.replicas for s in plan.stages if s.replicas > 1)


def simulate_plan(plan: Plan, max_events: int) -> Simulation:
    n = estimated_events(plan)
    if n > max_events:
        raise TooLarge(f"this plan's schedule has {n} events, over this server's limit of "
                       f"{max_events} for drawing or tracing; run `python -m planner simulate` locally")
    return simulate(plan)


def render(sim: Simulation, fmt: str, title: str = "") -> bytes:
    """The Gantt chart as `fmt` ("svg" or "png") bytes."""
    ranks = sorted({*sim.busy_ms, *(e.rank for e in sim.events)})
    row_of = {r: i for i, r in enumerate(ranks)}
    makespan = max([sim.iteration_ms, *(e.end_ms for e in sim.events)], default=0.0) or 1.0
    height = min(1.6 + 0.38 * len(ranks), 60.0)
    with _lock, matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "pipeplan"}):
        fig = Figure(figsize=(12, height), layout="constrained")
        ax = fig.add_subplot()
        for r in ranks:  # idle background: whatever the work does not cover is a bubble
            ax.broken_barh([(0.0, makespan)], (row_of[r] - 0.4, 0.8), facecolors=IDLE)
        spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for e in sim.events:
            spans.setdefault((e.rank, e.kind), []).append((e.start_ms, e.end_ms - e.start_ms))
        for (r, kind), bars in sorted(spans.items()):
            ax.broken_barh(bars, (row_of[r] - 0.4, 0.8), facecolors=COLORS.get(kind, "#8c8c8c"),
                           edgecolors="white", linewidth=0.4)
        if len(sim.events) <= MAX_LABELLED_EVENTS:
            for e in sim.events:
                if e.kind in ("F", "B") and e.end_ms - e.start_ms > makespan / 150:
                    ax.text((e.start_ms + e.end_ms) / 2, row_of[e.rank], str(e.mb), ha="center",
                            va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(ranks)),
                      [f"rank {r} (stage {sim.stage_of_rank.get(r, '?')})" for r in ranks])
        ax.set_ylim(len(ranks) - 0.5, -0.5)
        ax.set_xlim(0.0, makespan)
        ax.set_xlabel("time (ms)")
        ax.set_title(f"{title}iteration {sim.iteration_ms:.3f} ms, bubble fraction "
                     f"{sim.bubble_fraction + 0.0:.1%}", fontsize=10)
        handles = [Patch(color=c, label=LABELS[k]) for k, c in COLORS.items()]
        handles.append(Patch(color=IDLE, label="idle (bubble)"))
        fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
        buf = io.BytesIO()
        metadata: dict[str, Any] = {"Date": None} if fmt == "svg" else {}
        fig.savefig(buf, format=fmt, dpi=100, metadata=metadata)
    return buf.getvalue()
