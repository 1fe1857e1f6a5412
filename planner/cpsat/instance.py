"""The CP-SAT planner's input as plain integers: prefix tables over the layers, node classes of
the cluster, the microbatching and the time unit.

Internal module. Everything here is derived from `planner.cost` (the contract of
ARCHITECTURE.md) so the model and the simulator price a stage identically; only the rounding
to integer units differs (times in `1 / unit_per_ms` ms, memory in kilobytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.cost import (
    OPTIMIZER_EXTRA_COPIES,
    LayerTable,
    allreduce_ms,
    microbatch_scale,
    transfer_ms,
)
from planner.errors import PipeplanError
from planner.formats import GB, Cluster, PlanOptions

MICROBATCH_UNITS = 10**7  # one microbatch through the whole model maps to about this many
# units: products with microbatch counts then stay exact to ~1e-7 of the iteration time
MEMORY_UNIT_BYTES = 1000
PAIR_TABLE_LAYERS = 64  # up to this many layers the model prices each boundary's traffic by pairs


@dataclass(frozen=True)
class NodeClass:
    """Identical nodes (same device count, memory and speed) are interchangeable: the model
    decides how many devices of a class a stage uses, never which node (symmetry removed)."""

    nodes: tuple[int, ...]  # node indices in the cluster
    devices_per_node: int
    speed: float
    memory_bytes: float

    @property
    def capacity(self) -> int:
        return len(self.nodes) * self.devices_per_node


@dataclass(frozen=True)
class Placement:
    """Where a stage's replicas may sit: all on one node of class `classes[0]` (`local`), or
    spread over nodes of exactly the classes in `classes` (at least one device each)."""

    local: bool
    classes: tuple[int, ...]
    speed: float
    memory_bytes: float


@dataclass(frozen=True)
class Instance:
    num_layers: int
    num_microbatches: int
    microbatch_size: int
    scale: float
    schedule: str
    objective: str
    optimizer: str
    unit_per_ms: float  # integer time units per millisecond
    upper_units: int  # no iteration takes longer (domain of the time variables)
    speeds: tuple[float, ...]  # distinct device speeds
    fwd_prefix: dict[float, tuple[int, ...]]  # speed -> prefix of scaled fwd time, units
    bwd_prefix: dict[float, tuple[int, ...]]
    static_prefix_kb: tuple[int, ...]  # param * (2 + k), kilobytes
    act_prefix_kb: tuple[int, ...]  # scaled activation bytes per microbatch, kilobytes
    ar_intra_prefix: tuple[int, ...]  # param bytes / intra bandwidth, units
    ar_inter_prefix: tuple[int, ...]
    latency_units: int
    cut_intra: tuple[int, ...]  # index z (1..L-1): transfer of the tensors from layer z-1 to z
    cut_inter: tuple[int, ...]
    # index a * (L + 1) + z: transfer of the tensors produced in layers [a, z) and used by
    # layer z (all of them travel to the stage starting at z); None for large profiles
    pair_intra: tuple[int, ...] | None
    pair_inter: tuple[int, ...] | None
    classes: tuple[NodeClass, ...]
    placements: tuple[Placement, ...]
    num_devices: int
    powers_of_two: bool
    # exact (unrounded) per-layer numbers for diagnostics
    table: LayerTable

    def ms(self, units: float) -> float:
        return units / self.unit_per_ms


def node_classes(cluster: Cluster) -> tuple[NodeClass, ...]:
    groups: dict[tuple[int, float, float], list[int]] = {}
    for n, spec in enumerate(cluster.node_specs()):
        key = (spec.devices, spec.speed, spec.device_memory_gb * GB)
        groups.setdefault(key, []).append(n)
    return tuple(NodeClass(tuple(nodes), g, v, mem) for (g, v, mem), nodes in groups.items())


def placements(classes: tuple[NodeClass, ...]) -> tuple[Placement, ...]:
    """Local on each class, spread over each non-empty set of classes (every subset when there
    are at most four classes, else single classes and all of them)."""
    out = [Placement(True, (c,), k.speed, k.memory_bytes) for c, k in enumerate(classes)]
    n = len(classes)
    subsets: list[tuple[int, ...]] = []
    if n <= 4:
        for mask in range(1, 1 << n):
            subsets.append(tuple(c for c in range(n) if mask >> c & 1))
    else:
        subsets = [(c,) for c in range(n)] + [tuple(range(n))]
    for sub in subsets:
        if len(sub) == 1 and len(classes[sub[0]].nodes) < 2:
            continue  # one node cannot be spread over
        speed = min(classes[c].speed for c in sub)
        mem = min(classes[c].memory_bytes for c in sub)
        out.append(Placement(False, sub, speed, mem))
    return tuple(out)


def _rounded_prefix(values: list[float], factor: float) -> tuple[int, ...]:
    out, acc = [0], 0.0
    for v in values:
        acc += v
        out.append(round(acc * factor))
    return tuple(out)


def adjacent_bytes(table: LayerTable) -> list[int]:
    """`out[z]` = bytes of the tensors produced by layer z-1 and used by layer z: they cross
    any stage boundary at z into the very next stage, so they bound its traffic from below."""
    out = [0] * (table.num_layers + 1)
    for t in table.tensors:
        if t.producer >= 0 and t.producer + 1 in t.consumers:
            out[t.producer + 1] += t.nbytes
    return out


ABSURD_MS = 1e100  # a transfer slower than this is a unit mistake, not a cluster


def check_transfers(table: LayerTable, cluster: Cluster, scale: float) -> None:
    """PipeplanError unless every transfer and all-reduce of the model takes a finite, sane
    time on `cluster` (an absurdly small bandwidth or huge latency gives inf, then NaN in the
    model's time unit)."""
    adj = max(adjacent_bytes(table), default=0)
    params = table.param_bytes(0, table.num_layers)
    biggest = max([scale * adj, params] + [t.nbytes * scale for t in table.tensors], default=0.0)
    for name in ("intra_node_gb_per_s", "inter_node_gb_per_s"):
        gbps = getattr(cluster, name)
        with_lat = max(transfer_ms(biggest or 1.0, gbps, cluster.latency_us),
                       allreduce_ms(params or 1.0, cluster.num_devices, gbps, cluster.latency_us))
        if not math.isfinite(with_lat) or with_lat > ABSURD_MS:
            raise PipeplanError(
                f"cluster {name} = {gbps:g} GB/s with latency_us = {cluster.latency_us:g}: "
                f"moving the model's {biggest:.3g} bytes would take {with_lat:.3g} ms, which the "
                "planner cannot represent; give bandwidths in GB/s (e.g. 300 within a node, "
                "25 between nodes) and latency in microseconds (e.g. 5)")


def build_instance(table: LayerTable, cluster: Cluster, options: PlanOptions,
                   microbatch_size: int) -> Instance:
    L = table.num_layers
    scale = microbatch_scale(table.batch_size, microbatch_size)
    check_transfers(table, cluster, scale)
    m = options.global_batch // microbatch_size
    classes = node_classes(cluster)
    speeds = tuple(sorted({k.speed for k in classes}))
    slowest = speeds[0]
    lat_ms = cluster.latency_us / 1e3
    # an iteration can hardly exceed: everything on the slowest device, every byte inter-node
    total_ms = m * scale * table.compute_ms(0, L) / slowest
    adj = adjacent_bytes(table)
    comm_ms = 2 * sum(transfer_ms(scale * b, cluster.inter_node_gb_per_s, cluster.latency_us)
                      for b in adj)
    ar_ms = 2 * table.param_bytes(0, L) / (cluster.inter_node_gb_per_s * GB) * 1e3
    per_mb_ms = max(total_ms / m + comm_ms + 2 * cluster.num_devices * lat_ms, 1e-9)
    unit = MICROBATCH_UNITS / per_mb_ms
    upper_units = int(4 * (m * MICROBATCH_UNITS + ar_ms * unit)) + 10**6
    fwd = [x * scale for x in
           (table.fwd_prefix_ms[i + 1] - table.fwd_prefix_ms[i] for i in range(L))]
    bwd = [x * scale for x in
           (table.bwd_prefix_ms[i + 1] - table.bwd_prefix_ms[i] for i in range(L))]
    params = [table.param_bytes(i, i + 1) for i in range(L)]
    acts = [table.activation_bytes(i, i + 1) * scale for i in range(L)]
    k = OPTIMIZER_EXTRA_COPIES[options.optimizer]

    def cut(gbps: float) -> tuple[int, ...]:
        return tuple(0 if z in (0, L) else
                     round(transfer_ms(scale * adj[z], gbps, cluster.latency_us) * unit)
                     for z in range(L + 1))

    pair_intra = pair_inter = None
    if L <= PAIR_TABLE_LAYERS:
        into = [[0] * (L + 1) for _ in range(L + 1)]  # into[z][p]: bytes from layer p used by z
        for t in table.tensors:
            if t.producer >= 0:
                for c in t.consumers:
                    into[c][t.producer] += t.nbytes
        pair = [0] * ((L + 1) * (L + 1))
        for z in range(1, L):
            acc = 0
            for a in range(z - 1, -1, -1):
                acc += into[z][a]
                pair[a * (L + 1) + z] = acc

        def pair_table(gbps: float) -> tuple[int, ...]:
            return tuple(round(transfer_ms(scale * x, gbps, cluster.latency_us) * unit) if x else 0
                         for x in pair)

        pair_intra = pair_table(cluster.intra_node_gb_per_s)
        pair_inter = pair_table(cluster.inter_node_gb_per_s)

    return Instance(
        num_layers=L, num_microbatches=m, microbatch_size=microbatch_size, scale=scale,
        schedule=options.schedule, objective=options.objective, optimizer=options.optimizer,
        unit_per_ms=unit, upper_units=upper_units, speeds=speeds,
        fwd_prefix={v: _rounded_prefix(fwd, unit / v) for v in speeds},
        bwd_prefix={v: _rounded_prefix(bwd, unit / v) for v in speeds},
        static_prefix_kb=_rounded_prefix([p * (2 + k) for p in params], 1 / MEMORY_UNIT_BYTES),
        act_prefix_kb=_rounded_prefix(acts, 1 / MEMORY_UNIT_BYTES),
        ar_intra_prefix=_rounded_prefix(params, unit * 1e3 / (cluster.intra_node_gb_per_s * GB)),
        ar_inter_prefix=_rounded_prefix(params, unit * 1e3 / (cluster.inter_node_gb_per_s * GB)),
        latency_units=round(lat_ms * unit),
        cut_intra=cut(cluster.intra_node_gb_per_s),
        cut_inter=cut(cluster.inter_node_gb_per_s),
        pair_intra=pair_intra, pair_inter=pair_inter,
        classes=classes, placements=placements(classes), num_devices=cluster.num_devices,
        powers_of_two=options.powers_of_two, table=table,
    )


def replica_buckets(m: int, max_replicas: int, powers_of_two: bool) -> list[tuple[int, int]]:
    """Intervals of replica counts over which `ceil(m / r)` is constant (exact for every r up
    to 16, and wherever the interval is a single count)."""
    values = [r for r in range(1, max_replicas + 1)
              if not powers_of_two or r & (r - 1) == 0]
    buckets: list[tuple[int, int]] = []
    for r in values:
        if buckets and r > 16 and math.ceil(m / r) == math.ceil(m / buckets[-1][0]) \
                and buckets[-1][0] > 16:
            buckets[-1] = (buckets[-1][0], r)
        else:
            buckets.append((r, r))
    return buckets
