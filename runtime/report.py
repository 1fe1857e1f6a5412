"""The run report (planner.formats.Report) and the measured Chrome trace, from per-rank records.

Internal module. Definitions used in report.json:
- `iteration_ms`: median over steps after the first (all steps if only one) of rank 0's wall
  time per step, from drawing the batch to the end of the optimizer step. Rank 0 holds stage 0,
  whose last backward closes every step, so this is the pipeline's period.
- per rank, per iteration (medians over the same steps): `fwd_ms_per_microbatch`,
  `bwd_ms_per_microbatch` (compute only); `comm_ms` = time posting sends, waiting for their
  delivery at the flush and in gradient all-reduces; `idle_ms` = the rest of the rank's step
  (mostly waiting for a peer's activations or gradients: the pipeline bubble);
  `optimizer_ms` = the optimizer step (and zero_grad) per iteration, against the plan's
  `predicted_optimizer_ms`.
- the medians are over the last `timing_window_steps()` to twice as many steps in a longer run
  (each rank keeps only those steps' per-microbatch timings: a run of days kept every
  microbatch's forward and backward time, about 32 bytes each, and sent them all to rank 0 at the
  end); `step_ms` and `losses` hold every step (8 bytes a step each until the report is written).
- `peak_memory_bytes`: on CUDA `torch.cuda.max_memory_allocated`; on CPU the sum of parameter,
  buffer, gradient and optimizer-state bytes of the stage plus the peak bytes autograd held saved for
  the microbatches in flight, with on the last stage the loss's backward working memory
  during each B (`memory_measure` says which).
- `peak_activation_bytes`: that peak beyond parameters, gradients and optimizer state: saved
  tensors counted with saved-tensor hooks on every device type, and on CPU the loss's backward
  working memory (measured once, `StageExecutor._measure_loss_backward`).
- `peak_inflight_microbatches`: the most microbatches whose forward was done and backward not;
  `schedule_peak_inflight` is the planner simulator's figure for the same rank.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.formats import Plan, RankReport, Report
from planner.limits import out_of_range


@dataclass
class RankRecord:
    """What each rank sends to rank 0 at the end of a run."""

    rank: int
    stage: int
    replica: int
    step_ms: Sequence[float]  # every step
    fwd_ms: list[float]  # every microbatch forward of the steps kept (`dropped_steps`)
    bwd_ms: list[float]
    comm_ms: list[float]  # per step kept
    idle_ms: list[float]  # per step kept
    peak_memory_bytes: int
    memory_measure: str
    peak_inflight: int
    peak_activation_bytes: int  # bytes autograd held saved for the microbatches in flight
    events: list[tuple[str, str, int, int, float, float]] = field(default_factory=list)  # last step
    optimizer_ms: list[float] = field(default_factory=list)  # per step kept: optimizer.step + zero_grad
    dropped_steps: int = 0  # the first steps whose timings `trim_timings` let go (0: none)


DEFAULT_TIMING_WINDOW_STEPS = 2000


def timing_window_steps() -> int:
    """How many steps' timings a rank keeps at least (`PIPEPLAN_TIMING_WINDOW_STEPS`, default
    2000); it lets go of the oldest once it holds twice as many."""
    try:
        return max(2, int(os.environ.get("PIPEPLAN_TIMING_WINDOW_STEPS", DEFAULT_TIMING_WINDOW_STEPS)))
    except ValueError:
        return DEFAULT_TIMING_WINDOW_STEPS


def trim_timings(per_step: Sequence[list[float]], per_microbatch: Sequence[tuple[list[float], int]],
                 window: int) -> int:
    """At the end of a step: where the per-step lists hold more than 2 x `window` steps, drop
    their oldest steps down to `window`, and from each per-microbatch list (with its entries
    per step) as many steps' entries. Returns the steps dropped (0: nothing done). Amortized
    O(1) a step; each list stays under 2 x `window` steps."""
    kept = len(per_step[0]) if per_step else 0
    if kept <= 2 * window:
        return 0
    drop = kept - window
    for xs in per_step:
        del xs[:drop]
    for xs, per in per_microbatch:
        del xs[:drop * per]
    return drop


def _steady(xs: list[float]) -> list[float]:
    return xs[1:] if len(xs) > 1 else xs


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def finite_losses(losses: list[float]) -> list[float | None]:
    """The losses as a report keeps them: a NaN, an infinity or a loss beyond what pipeplan
    reads back (`planner.limits`) is None, so a run that diverged still writes its report."""
    return [x if out_of_range(x) is None else None for x in losses]


def build_report(plan: Plan, records: list[RankRecord], losses: list[float], steps: int,
                 schedule_peak: dict[int, int], optimizer: str | None = None) -> Report:
    records = sorted(records, key=lambda r: r.rank)
    it_ms = _median(_steady(records[0].step_ms))
    per_mb = plan.num_microbatches
    ranks = []
    for r in records:
        # the first step's microbatches are left out of the medians, unless trimmed already
        skip = (len(r.fwd_ms) // max(len(r.comm_ms), 1)
                if len(r.comm_ms) > 1 and not r.dropped_steps else 0)
        ranks.append(RankReport(
            rank=r.rank, stage=r.stage, replica=r.replica,
            fwd_ms_per_microbatch=_median(r.fwd_ms[skip:]),
            bwd_ms_per_microbatch=_median(r.bwd_ms[skip:]),
            comm_ms=_median(_steady(r.comm_ms)),
            idle_ms=_median(_steady(r.idle_ms)),
            peak_memory_bytes=r.peak_memory_bytes,
            peak_inflight_microbatches=r.peak_inflight,
            schedule_peak_inflight=schedule_peak.get(r.rank),
            memory_measure=r.memory_measure,
            peak_activation_bytes=r.peak_activation_bytes,
            predicted_memory_bytes=plan.stages[r.stage].predicted.memory_bytes,
            optimizer_ms=_median(_steady(r.optimizer_ms)),
            predicted_optimizer_ms=getattr(plan.stages[r.stage].predicted, "optimizer_ms", 0.0) or 0.0,
        ))
    return Report(
        plan_profile_sha256=plan.profile_sha256,
        steps=steps,
        iteration_ms=it_ms,
        samples_per_s=plan.global_batch / (it_ms / 1e3) if it_ms > 0 else 0.0,
        predicted_iteration_ms=plan.predicted.iteration_ms,
        predicted_samples_per_s=plan.predicted.throughput_samples_per_s,
        num_microbatches=per_mb,
        schedule=plan.schedule,
        step_ms=list(records[0].step_ms),
        losses=finite_losses(list(losses)),
        ranks=ranks,
        optimizer=optimizer,
    )


def measured_simulation(records: list[RankRecord], iteration_ms: float) -> object:
    """The last step's measured events as a planner Simulation, so the simulator's Chrome trace
    writer lays predicted and measured out the same way."""
    from planner.simulator import Event, Simulation

    t0 = min((e[4] for r in records for e in r.events), default=0.0)
    events = [
        Event(rank=r.rank, name=name, kind=kind, stage=stage, mb=mb,
              start_ms=(s - t0) * 1e3, end_ms=(e - t0) * 1e3)
        for r in records for (name, kind, stage, mb, s, e) in r.events
    ]
    end = max((ev.end_ms for ev in events), default=0.0)
    busy = {r.rank: sum(ev.end_ms - ev.start_ms for ev in events
                        if ev.rank == r.rank and ev.kind in ("F", "B", "W", "optimizer")) for r in records}
    comm = {r.rank: sum(ev.end_ms - ev.start_ms for ev in events
                        if ev.rank == r.rank and ev.kind == "allreduce") for r in records}
    idle = {k: max(end - busy[k] - comm[k], 0.0) for k in busy}
    total = end * len(records)
    return Simulation(
        events=sorted(events, key=lambda ev: (ev.rank, ev.start_ms)),
        iteration_ms=end, busy_ms=busy, comm_ms=comm, idle_ms=idle,
        bubble_fraction=sum(idle.values()) / total if total > 0 else 0.0,
        peak_inflight={r.rank: r.peak_inflight for r in records},
        peak_memory_bytes={r.rank: float(r.peak_memory_bytes) for r in records},
        stage_of_rank={r.rank: r.stage for r in records},
    )


def chrome_trace(sim: object, plan: Plan, iteration_ms: float) -> dict:
    """The measured last step as a Chrome trace, laid out by the planner's own writer (one
    track per rank), in process "measured"; the simulator's prediction for the plan sits
    beside it as process "predicted", so both open together in Perfetto."""
    from planner.simulator import simulate
    from planner.trace import chrome_trace as planner_trace
    from planner.trace import merge_traces

    meta = {
        "measured_iteration_ms": iteration_ms,
        "predicted_iteration_ms": plan.predicted.iteration_ms,
        "schedule": plan.schedule, "num_microbatches": plan.num_microbatches,
    }
    measured = planner_trace(sim, label="measured", pid=0, metadata=meta)  # type: ignore[arg-type]
    try:
        predicted = planner_trace(simulate(plan), label="predicted", pid=1)
    except Exception:  # noqa: BLE001 - a plan the simulator cannot handle still gets its trace
        return measured
    return merge_traces(measured, predicted)
