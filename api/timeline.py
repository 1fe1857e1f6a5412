"""Gantt chart of a plan's simulated schedule, drawn with matplotlib (Agg, no display): one row
per rank, forward and backward (and all-reduce) coloured, the rest of each row shaded as idle so
the pipeline bubbles are visible.

Small schedules are drawn bar by bar (microbatch numbers on the bars). Larger ones are
*aggregated into pixels*: the time axis is cut into `BINS` columns and, per rank row, each
column is a small stacked bar of the time shares of forward, backward, all-reduce and idle in
it (`pixels`). A bar narrower than a pixel therefore still shows (it used to
vanish under its white edge), 16k events stay a readable picture, and ranks beyond `MAX_ROWS`
share rows (the row shows their average). Runs in a worker process (`api.pool.RenderPool`),
never in the HTTP process.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402 - after choosing the backend
from matplotlib.patches import Patch  # noqa: E402

from planner.formats import Plan  # noqa: E402
from planner.simulator import Simulation, simulate  # noqa: E402

COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#c44e52", "allreduce": "#55a868", "optimizer": "#ccb974"}
LABELS = {"F": "forward", "B": "backward", "W": "weight gradient", "allreduce": "all-reduce",
          "optimizer": "optimizer step"}
IDLE = "#f4cccc"
OTHER = "#8c8c8c"
MAX_LABELLED_EVENTS = 600  # write microbatch numbers on the bars below this many events
MAX_BAR_EVENTS = 2_000  # draw bar by bar up to this many events (and MAX_BAR_RANKS ranks)
MAX_BAR_RANKS = 64
BINS = 1_100  # time columns of an aggregated picture (about the plot's width in pixels)
MAX_ROWS = 512  # rank rows of an aggregated picture; more ranks share rows
MAX_TICKS = 48  # rank labels on the y axis

_lock = threading.Lock()  # matplotlib's text and font caches are not thread-safe


class TooLarge(ValueError):
    """The schedule has more events than a picture can show."""


def estimated_events(plan: Plan) -> int:
    """Events a simulation of `plan` produces: a forward and a backward (and a W under zb-h1)
    per microbatch per stage, one all-reduce per replica of a replicated stage and one optimizer
    step per replica where the plan prices it (known before simulating)."""
    per_mb = 3 if plan.schedule == "zb-h1" else 2
    return per_mb * plan.num_microbatches * len(plan.stages) + sum(
        s.replicas for s in plan.stages if s.replicas > 1) + sum(
        s.replicas for s in plan.stages if (getattr(s.predicted, "optimizer_ms", 0.0) or 0.0) > 0)


def simulate_plan(plan: Plan, max_events: int) -> Simulation:
    n = estimated_events(plan)
    if n > max_events:
        raise TooLarge(f"this plan's schedule has {n} events, over this server's limit of "
                       f"{max_events} for drawing or tracing; run `python -m planner simulate` locally")
    return simulate(plan)


def _rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i:i + 2], 16) / 255.0 for i in (1, 3, 5)])


def coverage(sim: Simulation, ranks: list[int], rows: int, bins: int, makespan: float
             ) -> tuple[list[str], np.ndarray]:
    """(kinds, cov): `cov[k, row, col]` = the fraction of time column `col` that rank row `row`
    spends on kind `kinds[k]` (averaged over the ranks sharing the row)."""
    order = list(COLORS)
    kinds = sorted({e.kind for e in sim.events},
                   key=lambda k: (order.index(k) if k in order else len(order), k))
    kind_of = {k: i for i, k in enumerate(kinds)}
    row_of = {r: i * rows // len(ranks) for i, r in enumerate(ranks)}
    per_row = np.bincount(np.array([row_of[r] for r in ranks]), minlength=rows).astype(float)
    cov = np.zeros((len(kinds), rows, bins + 1))
    if not sim.events:
        return kinds, cov[:, :, :bins]
    k = np.array([kind_of[e.kind] for e in sim.events])
    row = np.array([row_of[e.rank] for e in sim.events])
    scale = bins / makespan
    s = np.clip(np.array([e.start_ms for e in sim.events]) * scale, 0, bins)
    t = np.clip(np.array([e.end_ms for e in sim.events]) * scale, 0, bins)
    lo, hi = np.floor(s).astype(int), np.floor(t).astype(int)
    same = lo == hi  # the whole event inside one column
    np.add.at(cov, (k[same], row[same], lo[same]), (t - s)[same])
    d = ~same
    np.add.at(cov, (k[d], row[d], lo[d]), (lo[d] + 1 - s[d]))  # first, partial column
    np.add.at(cov, (k[d], row[d], hi[d]), (t[d] - hi[d]))  # last, partial column
    full = np.zeros_like(cov)  # the columns in between, fully covered: a difference array
    np.add.at(full, (k[d], row[d], lo[d] + 1), 1.0)
    np.add.at(full, (k[d], row[d], hi[d]), -1.0)
    cov += np.cumsum(full, axis=2)
    cov = cov[:, :, :bins] / per_row[None, :, None]
    return kinds, np.clip(cov, 0.0, 1.0)


def pixels(kinds: list[str], cov: np.ndarray, sub_rows: int) -> np.ndarray:
    """RGB image (rows * sub_rows, bins, 3). Each column of a rank row is a little stacked bar:
    from the top, a share of its height per kind of work equal to that kind's share of the
    column's time, then idle. A column inside one bar is all that bar's colour; a column holding
    many events shows their mix (a third forward, two thirds backward, ...)."""
    colours = np.array([_rgb(COLORS.get(k, OTHER)) for k in kinds] + [_rgb(IDLE)], dtype=np.float32)
    n_kinds, rows, bins = cov.shape
    upper = np.cumsum(cov, axis=0)  # (kinds, rows, bins): where each kind's share ends
    y = (np.arange(sub_rows, dtype=np.float32) + 0.5) / sub_rows  # height of each sub-row
    # which kind covers height y: the first k whose cumulative share passes y (else idle)
    idx = (upper[:, :, None, :] <= y[None, None, :, None]).sum(axis=0)  # (rows, sub_rows, bins)
    image = colours[np.minimum(idx, n_kinds)]  # (rows, sub_rows, bins, 3)
    return image.reshape(rows * sub_rows, bins, 3)


def _bars(ax: Any, sim: Simulation, row_of: dict[int, int], makespan: float) -> None:
    for i in row_of.values():  # idle background: whatever the work does not cover is a bubble
        ax.broken_barh([(0.0, makespan)], (i - 0.4, 0.8), facecolors=IDLE)
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in sim.events:
        spans.setdefault((e.rank, e.kind), []).append((e.start_ms, e.end_ms - e.start_ms))
    narrowest = min((e.end_ms - e.start_ms for e in sim.events), default=makespan)
    edge = 0.4 if narrowest / makespan * BINS > 4 else 0.0  # white edges only where bars are wide
    for (r, kind), bars in sorted(spans.items()):
        ax.broken_barh(bars, (row_of[r] - 0.4, 0.8), facecolors=COLORS.get(kind, OTHER),
                       edgecolors="white", linewidth=edge)
    if len(sim.events) <= MAX_LABELLED_EVENTS:
        for e in sim.events:
            if e.kind in ("F", "B") and e.end_ms - e.start_ms > makespan / 150:
                ax.text((e.start_ms + e.end_ms) / 2, row_of[e.rank], str(e.mb), ha="center",
                        va="center", fontsize=6, color="white")


def render(sim: Simulation, fmt: str, title: str = "") -> bytes:
    """The Gantt chart as `fmt` ("svg" or "png") bytes."""
    ranks = sorted({*sim.busy_ms, *(e.rank for e in sim.events)})
    makespan = max([sim.iteration_ms, *(e.end_ms for e in sim.events)], default=0.0) or 1.0
    detailed = len(sim.events) <= MAX_BAR_EVENTS and len(ranks) <= MAX_BAR_RANKS
    rows = len(ranks) if detailed else min(len(ranks), MAX_ROWS)
    height = 1.6 + (0.38 * rows if rows <= 24 else max(9.0, min(0.12 * rows, 40.0)))
    with _lock, matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "pipeplan"}):
        fig = Figure(figsize=(12, height), layout="constrained")
        ax = fig.add_subplot()
        if detailed:
            _bars(ax, sim, {r: i for i, r in enumerate(ranks)}, makespan)
        else:
            kinds, cov = coverage(sim, ranks, rows, BINS, makespan)
            sub_rows = max(2, min(12, 2400 // rows))
            ax.imshow(pixels(kinds, cov, sub_rows), aspect="auto", interpolation="nearest",
                      extent=(0.0, makespan, rows - 0.5, -0.5))
            if rows <= 160:  # thin white lines between rank rows
                for i in range(1, rows):
                    ax.axhline(i - 0.5, color="white", linewidth=0.3)
        step = max(1, -(-rows // MAX_TICKS))
        ticks = list(range(0, rows, step))
        if rows == len(ranks):
            labels = [f"rank {ranks[i]} (stage {sim.stage_of_rank.get(ranks[i], '?')})" for i in ticks]
        else:  # several ranks per row: label the first rank of the row
            labels = [f"rank {ranks[-(-i * len(ranks) // rows)]}+" for i in ticks]
        ax.set_yticks(ticks, labels, fontsize=8 if rows <= 24 else 6)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_xlim(0.0, makespan)
        ax.set_xlabel("time (ms)")
        shown = "" if detailed else f" ({len(sim.events)} events aggregated per pixel)"
        ax.set_title(f"{title}iteration {sim.iteration_ms:.3f} ms, bubble fraction "
                     f"{max(sim.bubble_fraction, 0.0):.1%}{shown}", fontsize=10)
        present = {e.kind for e in sim.events} | {"F", "B"}
        handles = [Patch(color=c, label=LABELS[k]) for k, c in COLORS.items() if k in present]
        handles.append(Patch(color=IDLE, label="idle (bubble)"))
        fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
        buf = io.BytesIO()
        metadata: dict[str, Any] = {"Date": None} if fmt == "svg" else {}
        fig.savefig(buf, format=fmt, dpi=100, metadata=metadata)
    return buf.getvalue()
