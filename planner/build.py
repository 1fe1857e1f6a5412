"""From a candidate (stages, replicas, devices, microbatching) to a complete plan.json: the cost
model's per-stage numbers, the schedule every rank executes, and the simulator's prediction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import (
    LayerTable,
    PipelineCosts,
    layer_table,
    lower_bound_ms,
    microbatch_scale,
    pipeline_costs,
)
from planner.errors import PipeplanError
from planner.formats import (
    MAX_MICROBATCHES,
    Cluster,
    Device,
    Plan,
    PlanOptions,
    PlanStage,
    Predicted,
    Profile,
    SolverInfo,
    StagePredicted,
    digest,
)
from planner.partition import Candidate
from planner.schedules import (
    generate,
    memory_representatives,
    plan_schedule_fields,
    zb_h1_memory_deferrals,
)
from planner.simulator import Simulation, simulate_costs, simulate_generated
from planner.units import format_bytes


def largest_divisor_size(batch_size: int, global_batch: int, max_microbatches: int = MAX_MICROBATCHES) -> int:
    """The largest divisor of `global_batch` that is at most `batch_size`, found by the number of
    microbatches k = global_batch / size (the first divisor from ceil(global_batch / batch_size)
    up): at most `max_microbatches` steps, whatever the two numbers (a loop over the sizes took
    as many steps as the profile's batch size)."""
    first = -(-global_batch // batch_size)
    for k in range(first, max_microbatches + 1):
        if global_batch % k == 0:
            return global_batch // k
    raise PipeplanError(
        f"--global-batch {global_batch} makes more than {max_microbatches} microbatches of its "
        f"largest divisor up to the profile's batch size ({batch_size}): give a global batch "
        f"with a divisor near {batch_size}, or --microbatch-size")


def resolve_microbatch(profile: Profile, options: PlanOptions) -> tuple[int, int]:
    """(microbatch size, number of microbatches). Without `microbatch_size`: the largest divisor
    of the global batch that is at most the profile's batch size, refused where it makes more
    than MAX_MICROBATCHES microbatches (a prime global batch makes microbatches of 1)."""
    b = options.microbatch_size
    if b is None:
        b = largest_divisor_size(profile.batch_size, options.global_batch)
    if options.global_batch % b:
        raise PipeplanError(f"--global-batch {options.global_batch} is not a multiple of "
                            f"--microbatch-size {b}")
    return b, options.global_batch // b


@dataclass(frozen=True)
class Evaluation:
    """A candidate under the cost model and the simulator."""

    candidate: Candidate
    costs: PipelineCosts
    simulation: Simulation
    stage_memory_bytes: tuple[float, ...]  # peak per device, busiest replica
    deferred: tuple[int, ...] | None = None  # ZB-H1: the W's each stage defers (the schedule's shape)

    @property
    def iteration_ms(self) -> float:
        return self.simulation.iteration_ms

    @property
    def fits(self) -> bool:
        return all(m <= lim for m, lim in zip(self.stage_memory_bytes, self.costs.memory_limit_bytes,
                                              strict=True))

    def memory_overshoot(self) -> float:
        """Largest ratio of needed to available memory over the stages (<= 1: fits)."""
        return max(m / lim for m, lim in zip(self.stage_memory_bytes, self.costs.memory_limit_bytes,
                                            strict=True))


def evaluate(table: LayerTable, cluster: Cluster, candidate: Candidate, options: PlanOptions,
             devices: Sequence[Device] | None = None, record: bool = True,
             stage_cache: dict | None = None) -> Evaluation:
    """Cost model + schedule + simulation for one candidate (what every method is judged by).
    `devices` (`cluster.devices()`) may be passed by a caller that evaluates many candidates;
    without `record` the simulation keeps no events (the search: same times and memory);
    `stage_cache` keeps each stage's costs between calls (`pipeline_costs`)."""
    candidate.check(table.num_layers, len(devices) if devices is not None else cluster.num_devices)
    costs = pipeline_costs(table, cluster, candidate, options.optimizer, devices, stage_cache)
    m = candidate.num_microbatches
    deferred = schedule_deferrals(costs, options.schedule)
    if record:
        sim = simulate_costs(costs, generate(options.schedule, costs.stage_devices, m, deferred),
                             True, memory_representatives(costs.stage_devices, m))
    else:
        sim = simulate_generated(costs, options.schedule, deferred)
    memory = tuple(max(sim.peak_memory_bytes[d] for d in devs) for devs in costs.stage_devices)
    return Evaluation(candidate, costs, sim, memory, tuple(deferred) if deferred is not None else None)


def schedule_deferrals(costs: PipelineCosts, schedule: str) -> list[int] | None:
    """ZB-H1: the W's each stage defers so no stage's peak exceeds the busiest stage's 1F1B
    peak (`planner.schedules.zb_h1_memory_deferrals`); other schedules: None."""
    return zb_h1_memory_deferrals(costs) if schedule == "zb-h1" else None


def stage_split_fields(costs: PipelineCosts, s: int) -> dict[str, float]:
    """What the simulator needs of stage s beyond fwd / bwd: its backward's B / W split and the
    memory it holds between them and during a (recomputed) backward."""
    b, w = costs.bwd_split(s)
    out = {"bwd_input_ms": b, "bwd_weight_ms": w}
    if costs.weight_hold_bytes_per_microbatch is not None:
        out["weight_hold_bytes_per_microbatch"] = costs.weight_hold_bytes_per_microbatch[s]
    if costs.transient_bytes is not None:
        out["transient_bytes"] = costs.transient_bytes[s]
    if costs.loss_transient_bytes is not None and costs.loss_transient_bytes[s]:
        out["loss_transient_bytes"] = costs.loss_transient_bytes[s]
    return out


def memory_error(ev: Evaluation, method: str) -> PipeplanError:
    worst = max(range(len(ev.stage_memory_bytes)),
                key=lambda s: ev.stage_memory_bytes[s] / ev.costs.memory_limit_bytes[s])
    need = max(ev.stage_memory_bytes)
    return PipeplanError(
        f"the plan of method {method!r} does not fit in device memory: stage {worst} needs "
        f"{format_bytes(ev.stage_memory_bytes[worst])} per device but its devices have "
        f"{format_bytes(ev.costs.memory_limit_bytes[worst])}; this plan would need "
        f"{format_bytes(need)} per device. Try more devices, a smaller --microbatch-size, "
        "--optimizer sgd or momentum, --schedule 1f1b, or another --method.")


def build_plan(profile: Profile, cluster: Cluster, candidate: Candidate, options: PlanOptions,
               table: LayerTable | None = None, evaluation: Evaluation | None = None) -> Plan:
    """Every plan.json field for `candidate` (it need not fit memory: see `Evaluation.fits`)."""
    table = table or layer_table(profile)
    ev = evaluation or evaluate(table, cluster, candidate, options)
    costs, sim = ev.costs, ev.simulation
    m, b = candidate.num_microbatches, candidate.microbatch_size
    devices = cluster.devices()
    lb = lower_bound_ms(table, m, microbatch_scale(table.batch_size, b), sum(d.speed for d in devices))
    stages = []
    for s, st in enumerate(candidate.stages):
        sends = [{"to": t, "bytes": snd.nbytes, "ms": snd.ms}
                 for (src, t), snd in costs.sends.items() if src == s]
        t = getattr(st, "tp", 1)
        stages.append(PlanStage(
            index=s, layers=list(table.names[st.start:st.stop]), replicas=st.replicas,
            devices=list(st.devices), **({"tp": t} if t > 1 else {}),
            predicted=StagePredicted(
                fwd_ms=costs.fwd_ms[s], bwd_ms=costs.bwd_ms[s],
                compute_ms=costs.fwd_ms[s] + costs.bwd_ms[s],
                memory_bytes=math.ceil(ev.stage_memory_bytes[s]),
                # rounded up as the memory is: a stage that fits never shows more than its limit
                memory_limit_bytes=math.ceil(costs.memory_limit_bytes[s]),
                allreduce_ms=costs.allreduce_ms[s],
                optimizer_ms=costs.optimizer_ms[s] if costs.optimizer_ms is not None else 0.0,
                static_memory_bytes=costs.static_memory_bytes[s],
                activation_bytes_per_microbatch=costs.activation_bytes_per_microbatch[s],
                peak_inflight=max(sim.peak_inflight[d] for d in st.devices[::t]),
                sends=sends,
                **stage_split_fields(costs, s),
                **({"tp_comm_fwd_ms": costs.tp_comm_fwd_ms[s],
                    "tp_comm_bwd_ms": costs.tp_comm_bwd_ms[s]} if t > 1 else {}),
            ),
            recompute=st.recompute,  # the parameters alone (the runtime checks the model it builds)
            param_bytes=table.param_bytes(st.start, st.stop) - table.buffer_bytes(st.start, st.stop),
            frozen_param_bytes=table.frozen_bytes(st.start, st.stop) - table.buffer_bytes(st.start, st.stop),
        ))
    it = sim.iteration_ms
    solver = {"name": options.method, "status": "HEURISTIC", **candidate.solver}
    rank_actions, generator = plan_schedule_fields(
        options.schedule, [st.devices for st in candidate.stages], m,
        tps=[getattr(st, "tp", 1) for st in candidate.stages],
        deferred=schedule_deferrals(costs, options.schedule))
    return Plan(
        profile_sha256=digest(profile), model=profile.model, cluster=cluster,
        options=options.model_copy(update={"microbatch_size": b}), schedule=options.schedule,
        global_batch=options.global_batch, microbatch_size=b, num_microbatches=m,
        stages=stages,
        predicted=Predicted(
            iteration_ms=it,
            throughput_samples_per_s=options.global_batch / (it / 1e3) if it > 0 else math.inf,
            lower_bound_ms=lb, bubble_fraction=sim.bubble_fraction,
            ratio_to_lower_bound=it / lb if lb > 0 else 1.0,
            fits_memory=ev.fits, unused_devices=cluster.num_devices - sum(len(st.devices) for st in candidate.stages),
        ),
        solver=SolverInfo.model_validate(solver),
        rank_actions=rank_actions, generator=generator,
        # how the profiler cut the model into layers: the runtime traces it the same way
        **({"granularity": g} if (g := getattr(profile, "granularity", None)) else {}),
        # the batch the profile measured: the sends' bytes scale from it (the runtime's check of
        # the model's input sizes allows for tensors that do not grow with the batch)
        profile_batch_size=profile.batch_size,
    )
