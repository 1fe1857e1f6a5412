"""Plain-text tables of plans and simulations for the CLI (pure functions returning strings)."""

from __future__ import annotations

from planner.formats import Plan
from planner.simulator import Simulation
from planner.units import format_bytes


def _layers(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)})"


def _devices(devs: list[int]) -> str:
    if len(devs) > 1 and devs == list(range(devs[0], devs[-1] + 1)):
        return f"{devs[0]}-{devs[-1]}"
    text = ",".join(map(str, devs))
    return text if len(text) <= 24 else text[:21] + "..."


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


def format_plan(plan: Plan, max_stages: int = 64) -> str:
    rows = []
    opt = any(getattr(st.predicted, "optimizer_ms", 0.0) for st in plan.stages)
    for st in plan.stages[:max_stages]:
        p = st.predicted
        rows.append([
            str(st.index), _layers(st.layers),
            str(st.replicas) + (f" x tp {t}" if (t := getattr(st, "tp", 1)) > 1 else ""),
            _devices(st.devices),
            f"{p.compute_ms:.2f} ({p.fwd_ms:.2f}+{p.bwd_ms:.2f})"
            + (f", TP comm {c:.2f}" if (c := (getattr(p, "tp_comm_fwd_ms", 0.0) or 0.0)
                                             + (getattr(p, "tp_comm_bwd_ms", 0.0) or 0.0)) > 0 else ""),
            f"{p.allreduce_ms:.2f}",
            *([f"{p.optimizer_ms:.2f}"] if opt else []),
            f"{format_bytes(p.memory_bytes)} / {format_bytes(p.memory_limit_bytes)}",
        ])
    text = format_table(["stage", "layers", "replicas", "devices", "compute ms (fwd+bwd)",
                         "allreduce ms", *(["optimizer ms"] if opt else []), "memory / limit"], rows)
    if len(plan.stages) > max_stages:
        text += f"\n... {len(plan.stages) - max_stages} more stages"
    pr, sv = plan.predicted, plan.solver
    bounded = plan.options.objective == "iteration"  # the search bounds iteration time only
    gap = f", gap {sv.gap:.1%}" if sv.gap is not None and bounded else ""
    unused = getattr(pr, "unused_devices", 0) or 0
    text += (
        f"\n\n{plan.schedule} · {plan.num_microbatches} microbatches of {plan.microbatch_size} "
        f"(global batch {plan.global_batch}) · {plan.world_size} of {plan.cluster.num_devices} devices"
        + (f" ({unused} unused)" if unused else "")
        + f"\npredicted iteration {_ms(pr.iteration_ms)} ms · throughput "
        f"{pr.throughput_samples_per_s:.1f} samples/s · bubble {max(pr.bubble_fraction, 0.0):.1%}"
        + (f"\nlower bound {_ms(sv.bound) if sv.bound is not None else ''} ms (the search's: no plan is faster) · work bound "
           if sv.bound is not None and bounded else
           "\nlower bound of the throughput objective: none (the search bounds iteration time) · "
           "work bound " if not bounded else "\nlower bound (work) ")
        + f"{_ms(pr.lower_bound_ms)} ms (the model's work over every device) · predicted / work bound "
        f"{pr.ratio_to_lower_bound:.3f}"
        f"\nmethod {sv.name} · status {sv.status}{gap} · wall {sv.wall_s:.2f} s"
    )
    if getattr(sv, "clock_stopped", False):
        text += ("\nthe wall-clock safety net stopped the search before its work budget was "
                 "spent (this machine is much slower or busier than the budget assumes): "
                 "another run may give another plan")
    return text


def _ms(x: float) -> str:
    """Milliseconds to 2 decimals, or 3 significant digits below 0.01 (a work bound of 0.004 ms
    over 60,000 devices printed as 0.00)."""
    return f"{x:.2f}" if x == 0 or abs(x) >= 0.01 else f"{x:.3g}"


def format_simulation(sim: Simulation, max_ranks: int = 32) -> str:
    ranks = sorted(sim.busy_ms)
    rows = [[str(r), str(sim.stage_of_rank.get(r, "")), f"{sim.busy_ms[r]:.2f}",
             f"{sim.comm_ms[r]:.2f}", f"{sim.idle_ms[r]:.2f}", str(sim.peak_inflight[r]),
             format_bytes(sim.peak_memory_bytes.get(r, 0.0))] for r in ranks[:max_ranks]]
    text = format_table(["rank", "stage", "busy ms", "allreduce ms", "idle ms", "peak in-flight",
                         "peak memory"], rows)
    if len(ranks) > max_ranks:
        text += f"\n... {len(ranks) - max_ranks} more ranks"
    return text + (f"\n\niteration {sim.iteration_ms:.2f} ms · bubble {max(sim.bubble_fraction, 0.0):.1%}")
