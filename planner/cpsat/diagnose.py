"""Why no plan fits: the stage that cannot fit, the memory it needs per device, what would fit.

Internal module; the numbers come from `planner.cost`."""

from __future__ import annotations

from planner.cost import LayerTable, microbatch_scale, stage_memory_bytes, static_memory_bytes
from planner.errors import PipeplanError
from planner.formats import Cluster
from planner.units import format_bytes


def infeasible_error(table: LayerTable, cluster: Cluster, optimizer: str, schedule: str,
                     microbatch_sizes: list[int], global_batch: int) -> PipeplanError:
    """A message for a model/cluster pair with no plan under the memory limits."""
    devices = cluster.devices()
    biggest = max(d.memory_bytes for d in devices)
    D = len(devices)
    b = min(microbatch_sizes)
    scale = microbatch_scale(table.batch_size, b)
    L = table.num_layers

    def need(a: int, z: int, inflight: int) -> float:
        return stage_memory_bytes(table.param_bytes(a, z), table.activation_bytes(a, z), scale,
                                  inflight, optimizer)

    # the single layer that does not fit anywhere, even alone with one microbatch in flight
    worst = max(range(L), key=lambda i: need(i, i + 1, 1))
    if need(worst, worst + 1, 1) > biggest:
        w = need(worst, worst + 1, 1)
        static = static_memory_bytes(table.param_bytes(worst, worst + 1), optimizer)
        hint = ("a smaller microbatch" if static <= biggest else
                f"devices with at least {format_bytes(w)} or an optimizer with less state (sgd)")
        return PipeplanError(
            f"layer {table.names[worst]!r} alone needs {format_bytes(w)} per device "
            f"(microbatch size {b}, optimizer {optimizer}) but the largest device has "
            f"{format_bytes(biggest)}; try {hint}")
    # greedy: fill stages front to back with as many layers as fit on the largest device;
    # the 1F1B stage s of S keeps up to S - s microbatches (GPipe: all m of them)
    m = global_batch // b
    stages: list[tuple[int, int]] = []
    a = 0
    for s_guess in range(1, L + 1):
        stages, a = [], 0
        ok = True
        while a < L:
            s = len(stages)
            inflight = m if schedule == "gpipe" else max(1, min(m, s_guess - s))
            z = a + 1
            if need(a, z, inflight) > biggest:
                ok = False
                break
            while z < L and need(a, z + 1, inflight) <= biggest:
                z += 1
            stages.append((a, z))
            a = z
        if ok and len(stages) <= s_guess:
            break
    first_a, first_z = stages[0] if stages else (0, L)
    inflight = m if schedule == "gpipe" else min(m, max(len(stages), 1))
    per_device = need(first_a, first_z, inflight)
    where = (f"stage 0 (layers {table.names[first_a]!r}..{table.names[first_z - 1]!r}) needs "
             f"{format_bytes(per_device)} per device with {inflight} microbatches in flight")
    if len(stages) > D:
        return PipeplanError(
            f"no plan fits: on devices of {format_bytes(biggest)} the model needs at least "
            f"{len(stages)} pipeline stages but the cluster has {D} devices; {where}. Give more "
            f"devices or a smaller microbatch size than {b}")
    return PipeplanError(
        f"no plan found that fits in device memory ({format_bytes(biggest)} per device, {D} "
        f"devices): with {len(stages)} stages {where}. Try a smaller microbatch size than {b}, "
        f"--optimizer sgd, more devices, or a longer --time-limit")
