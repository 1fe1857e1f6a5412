"""Clear errors: a cluster whose links make transfers absurd, and a model no plan fits."""

from __future__ import annotations

import math

from planner.cost import LayerTable, allreduce_ms, stage_memory_bytes, transfer_ms
from planner.errors import PipeplanError
from planner.formats import Cluster, PlanOptions
from planner.units import format_bytes

ABSURD_MS = 1e100  # a transfer slower than this is a unit mistake, not a cluster


def check_transfers(table: LayerTable, cluster: Cluster, scale: float) -> None:
    """PipeplanError unless every transfer and all-reduce of the model takes a finite, sane
    time on `cluster` (an absurdly small bandwidth or huge latency gives inf, then NaN)."""
    params = table.param_bytes(0, table.num_layers)
    biggest = max([params] + [t.nbytes * scale for t in table.tensors], default=0.0)
    for name in ("intra_node_gb_per_s", "inter_node_gb_per_s"):
        gbps = getattr(cluster, name)
        ms = max(transfer_ms(biggest or 1.0, gbps, cluster.latency_us),
                 allreduce_ms(params or 1.0, cluster.num_devices, gbps, cluster.latency_us))
        if not math.isfinite(ms) or ms > ABSURD_MS:
            raise PipeplanError(
                f"cluster {name} = {gbps:g} GB/s with latency_us = {cluster.latency_us:g}: "
                f"moving the model's {biggest:.3g} bytes would take {ms:.3g} ms, which the "
                "planner cannot represent; give bandwidths in GB/s (e.g. 300 within a node, "
                "25 between nodes) and latency in microseconds (e.g. 5)")


def infeasible_error(table: LayerTable, cluster: Cluster, options: PlanOptions,
                     sizes: list[int], ev, proven: bool = False) -> PipeplanError:
    """Why no plan fits. `ev` (the search's Evaluator) holds every plan it scored: the one that
    came closest is described with its own figures, so the message never contradicts itself.
    `proven`: the bound's DP admits no plan of any size (none fits, whatever the time limit)."""
    devices = cluster.devices()
    biggest = max(d.memory_bytes for d in devices)
    b = min(sizes)
    scale = b / table.batch_size
    L = table.num_layers
    degrees = getattr(ev, "degrees", (1,))

    def alone(i: int, t: int) -> float:  # layer i on one of t TP devices, one microbatch
        if t == 1:
            return stage_memory_bytes(table.param_bytes(i, i + 1), table.activation_bytes(i, i + 1),
                                      scale, 1, options.optimizer, table.frozen_bytes(i, i + 1))
        tt = table.at_degree(t)
        return stage_memory_bytes(tt.span("param_prefix_bytes", i, i + 1),
                                  tt.span("activation_prefix_bytes", i, i + 1), scale, 1, options.optimizer)

    # a single layer that fits nowhere, even alone with one microbatch in flight (and sharded
    # over the largest TP degree allowed; recomputing one layer saves nothing)
    need1 = [min(alone(i, t) for t in degrees) for i in range(L)]
    worst = max(range(L), key=lambda i: need1[i])
    sharded = f", even sharded over up to {max(degrees)} TP devices" if max(degrees) > 1 else ""
    more_tp = ", profile more TP degrees (--tp)" if table.tp else ""
    if need1[worst] > biggest:
        return PipeplanError(
            f"layer {table.names[worst]!r} alone needs {format_bytes(need1[worst])} per device "
            f"(microbatch size {b}, optimizer {options.optimizer}, one microbatch in flight"
            f"{sharded}) but the largest device has {format_bytes(biggest)}: no plan can fit. "
            f"Give devices with more memory, a smaller microbatch size{more_tp} or an optimizer "
            "with less state (sgd)")
    # each layer's own state, a tensor several layers hold at its first holder only (the
    # prefix sums): what the model holds at least, once, whatever its stages
    own = [table.param_prefix_bytes[i + 1] - table.param_prefix_bytes[i] for i in range(L)]
    params = sum(min([own[i]]
                     + [t * table.at_degree(t).span("param_prefix_bytes", i, i + 1)
                        for t in degrees if t > 1]) for i in range(L))
    total_static = stage_memory_bytes(params, 0, 0, 0, options.optimizer,
                                      table.frozen_bytes(0, L) if params == table.param_bytes(0, L) else 0.0)
    if total_static > biggest * len(devices):
        return PipeplanError(
            f"the model's parameters, gradients and {options.optimizer} state take "
            f"{format_bytes(total_static)}, more than the cluster's {len(devices)} devices of "
            f"{format_bytes(biggest)} hold together: no plan can fit. Give more devices"
            + (" or larger ones" if options.optimizer == "sgd" else " or --optimizer sgd"))
    closest = min((s for s, c in ev.cache.values() if c is not None),
                  key=lambda s: s.overshoot, default=None)
    detail = ""
    if closest is not None and math.isfinite(closest.worst):
        detail = (f"; the closest plan found ({closest.stages} stages on {closest.devices} "
                  f"devices) needs {closest.worst:.2f}x the memory of its smallest device")
    tries = ([] if b <= 1 else ["a smaller microbatch size"]) \
        + ([] if options.optimizer == "sgd" else ["--optimizer sgd"]) \
        + ([] if options.allow_recompute else ["recomputation (leave out --no-recompute)"]) \
        + (["--schedule 1f1b (GPipe keeps every microbatch's activations)"] if options.schedule == "gpipe" else []) \
        + (["more or larger devices"] if proven else
           ["more devices, devices with more memory or a longer --time-limit (on a large model the "
            "search may not have reached a plan that fits)"])
    what = (f"no {options.schedule} plan fits" if proven else "no plan found that fits")
    return PipeplanError(
        f"{what} in device memory ({format_bytes(biggest)} per device, "
        f"{len(devices)} devices, microbatch sizes {','.join(map(str, sizes))}){detail}. Try "
        + ", ".join(tries[:-1]) + (" or " if len(tries) > 1 else "") + tries[-1])
