"""Plans for the runtime tests: explicit stages over a model's traced layers, with the
planner's own schedule generator (the runtime must execute exactly these action lists)."""

from __future__ import annotations

from pathlib import Path

import torch

from planner.formats import (
    Cluster,
    ModelRef,
    Plan,
    PlanOptions,
    PlanStage,
    Predicted,
    SolverInfo,
    StagePredicted,
)
from planner.io import save_model
from planner.schedules import plan_schedule_fields
from profiler.loader import build_checked, file_sha256, load_model_file
from runtime import stages as runtime_stages


def make_plan(model_path: str | Path, layers: list[str], split: list[int], replicas: list[int],
              *, schedule: str = "1f1b", global_batch: int = 8, microbatch_size: int = 2,
              recompute: list[bool] | None = None, tp: list[int] | None = None,
              deferred: list[int] | None = None) -> Plan:
    assert sum(split) == len(layers)
    stages, start, rank = [], 0, 0
    tp = tp or [1] * len(split)
    for s, (n, r, t) in enumerate(zip(split, replicas, tp, strict=True)):
        stages.append(PlanStage(
            index=s, layers=layers[start:start + n], replicas=r, tp=t,
            devices=list(range(rank, rank + r * t)),
            predicted=StagePredicted(fwd_ms=1.0, bwd_ms=2.0, compute_ms=3.0, memory_bytes=0,
                                     memory_limit_bytes=10**9),
            recompute=bool(recompute[s]) if recompute else False,
        ))
        start += n
        rank += r * t
    m = global_batch // microbatch_size
    rank_actions, generator = plan_schedule_fields(schedule, [s.devices for s in stages], m,
                                                   tps=[s.tp for s in stages], deferred=deferred)
    return Plan(
        profile_sha256="test", model=ModelRef(path=str(model_path), sha256=file_sha256(model_path)),
        cluster=Cluster(nodes=1, devices_per_node=rank, device_memory_gb=1, intra_node_gb_per_s=10,
                        inter_node_gb_per_s=1),
        options=PlanOptions(global_batch=global_batch, microbatch_size=microbatch_size,
                            schedule=schedule, method="manual", optimizer="sgd"),  # type: ignore[arg-type]
        schedule=schedule, global_batch=global_batch, microbatch_size=microbatch_size,  # type: ignore[arg-type]
        num_microbatches=m, stages=stages,
        predicted=Predicted(iteration_ms=10.0, throughput_samples_per_s=1.0, lower_bound_ms=1.0,
                            bubble_fraction=0.0, ratio_to_lower_bound=1.0),
        solver=SolverInfo(name="manual", status="MANUAL"),
        rank_actions=rank_actions, generator=generator,
    )


def write_plan(plan: Plan, path: Path) -> Path:
    save_model(plan, path)
    return path


def traced_layers(model_path: str | Path, microbatch_size: int = 2) -> list[str]:
    mf = load_model_file(model_path)
    torch.manual_seed(0)
    model = build_checked(mf, microbatch_size)  # lazy modules initialised, as the runtime does
    inputs, _ = mf.make_batch(microbatch_size)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    graph = runtime_stages.trace_model(model, inputs, "blocks")
    return runtime_stages.layer_names(graph)
