"""PipeDream's partitioning dynamic programme (Narayanan et al., "PipeDream: Generalized
Pipeline Parallelism for DNN Training", SOSP 2019, section 3.1), in this project's cost units.

The DP chooses stage boundaries and a replica count per stage to minimise the time of the
slowest stage per microbatch, hierarchically over the cluster's levels (devices in a node, then
nodes), exactly as the paper's recurrences:

    T(i..j, r) = compute(i..j) / r + sync(i..j, r)              one stage on r units
    A(j, m)    = min( T(0..j, m),
                      min_{k<j, 1<=m'<m} max(A(k, m - m'), 2 * transfer(cut_k) / m', T(k+1..j, m')) )

Units at level 1 are devices (compute = per-microbatch fwd + bwd on one device, intra-node
bandwidth); at level 2 they are whole nodes running a level-1 pipeline (compute = that
pipeline's A, inter-node bandwidth, sync divided by the devices per node as PipeDream's code
does). `sync` is the ring all-reduce of ARCHITECTURE.md amortised over the iteration's
microbatches. The paper takes max(compute / r, sync) because PipeDream's asynchronous weight
sync overlaps compute; with a flush (this project's 1F1B and GPipe) the all-reduce follows the
last backward, so, as issue 3 specifies, the two add. Transfers stay a separate max term: they
delay, they do not occupy a device. Like PipeDream, a pipeline may leave units unused when that
is faster.

Memory check (PipeDream's, with this project's memory formula): a stage fits if
`param * (2 + k) + act * inflight <= device memory`, with `inflight` bounded by the schedule:
GPipe `ceil(m / r)`, 1F1B `min(ceil(m / r), ceil((r + downstream) / r))` where `downstream` is
the number of devices that can follow the stage. On a multi-node cluster the level-1 check first
counts the node's own devices only (PipeDream checks each level locally); if the plan then does
not fit under the full cost model, the DP reruns counting every device of the other nodes too
(an upper bound, so that plan fits whenever the DP finds one).

Models with more than `max_groups` layers are first coarsened into groups of consecutive
layers of about equal compute (the DP is cubic in the number of layers); stages then cut only
at group boundaries. Everything here is plain numbers: `solve_pipedream` turns the result into
a Candidate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from planner.cost import (
    OPTIMIZER_EXTRA_COPIES,
    LayerTable,
    layer_table,
    microbatch_scale,
    transfer_ms,
)
from planner.errors import PipeplanError
from planner.formats import GB, Cluster, PlanOptions, Profile
from planner.partition import Candidate, StageChoice
from planner.units import format_bytes

INF = math.inf


@dataclass(frozen=True)
class DPInput:
    """Per group (a run of consecutive layers): numbers already scaled to the microbatch."""

    compute_ms: np.ndarray  # fwd + bwd per microbatch on one device of speed 1 (already / speed)
    param_bytes: np.ndarray
    activation_bytes: np.ndarray  # per microbatch
    cut_bytes: np.ndarray  # per microbatch, boundary after group k (len n - 1)
    num_microbatches: int
    memory_limit_bytes: float
    optimizer: str
    schedule: str
    latency_us: float = 0.0


def _prefix(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(x, dtype=float)])


def allreduce_vec_ms(param_bytes: np.ndarray, r: np.ndarray, gb_per_s: float, latency_us: float) -> np.ndarray:
    """Ring all-reduce (ARCHITECTURE.md), vectorised; zero for one replica or no parameters."""
    t = 2 * (r - 1) / r * param_bytes / (gb_per_s * GB) * 1e3 + 2 * (r - 1) * latency_us / 1e3
    return np.where((r > 1) & (param_bytes > 0), t, 0.0)


def inflight_bound(schedule: str, num_microbatches: int, r: np.ndarray, downstream: np.ndarray | int
                   ) -> np.ndarray:
    per_replica = np.ceil(num_microbatches / r)
    if schedule == "gpipe":
        return per_replica
    return np.minimum(per_replica, np.ceil((r + downstream) / r))


def pipeline_table(stage_time, bnd_ms: np.ndarray, n: int, units: int, start: int):
    """The DP for pipelines over groups start..j using exactly m units (1..units).

    `stage_time(j, used)` -> array [r-1, i] of the time of stage i..j on r units when `used`
    units are in use up to and including that stage (INF = does not fit). Returns (A, choice):
    A[j, m] (INF if impossible) and choice[(j, m)] = None (one stage) or (k, m')."""
    A = np.full((n, units + 1), INF)
    choice: dict[tuple[int, int], tuple[int, int] | None] = {}
    for j in range(start, n):
        for m in range(1, units + 1):
            T = stage_time(j, m)  # (units, j + 1)
            best, arg = T[m - 1, start], None
            if m > 1 and j > start:
                prev = A[start:j, m - 1:0:-1].T  # [m'-1, k - start] = A[k, m - m']
                mp = np.arange(1, m)[:, None]
                val = np.maximum(np.maximum(prev, bnd_ms[start:j][None, :] / mp), T[: m - 1, start + 1: j + 1])
                flat = int(np.argmin(val))
                if val.flat[flat] < best:
                    best = float(val.flat[flat])
                    arg = (start + flat % (j - start), flat // (j - start) + 1)
            A[j, m] = best
            choice[(j, m)] = arg
    return A, choice


def _unroll(choice, j: int, m: int, start: int) -> list[tuple[int, int, int]]:
    """Stages (first group, last group, units) of the table's pipeline ending at j with m units."""
    out = []
    while True:
        c = choice[(j, m)]
        if c is None:
            out.append((start, j, m))
            return out[::-1]
        k, mp = c
        out.append((k + 1, j, mp))
        j, m = k, m - mp


def _device_stage_time(inp: DPInput, gb_per_s: float, units: int, downstream_extra: int):
    """Level 1: stages on devices, with the memory check."""
    P, W, Act = _prefix(inp.compute_ms), _prefix(inp.param_bytes), _prefix(inp.activation_bytes)
    r = np.arange(1, units + 1, dtype=float)[:, None]
    k = OPTIMIZER_EXTRA_COPIES[inp.optimizer]

    def stage_time(j: int, used: int) -> np.ndarray:
        comp = P[j + 1] - P[: j + 1]
        params = W[j + 1] - W[: j + 1]
        act = Act[j + 1] - Act[: j + 1]
        sync = allreduce_vec_ms(params[None, :], r, gb_per_s, inp.latency_us) / inp.num_microbatches
        t = comp[None, :] / r + sync
        inflight = inflight_bound(inp.schedule, inp.num_microbatches, r, units - used + downstream_extra)
        mem = params[None, :] * (2 + k) + act[None, :] * inflight
        return np.where(mem <= inp.memory_limit_bytes, t, INF)

    return stage_time


@dataclass(frozen=True)
class DPResult:
    objective_ms: float  # the slowest stage's time per microbatch, PipeDream's objective
    stages: list[tuple[int, int, tuple[int, ...]]]  # first group, last group, unit-local devices


def solve_flat(inp: DPInput, devices: int, gb_per_s: float) -> DPResult:
    """One level: `devices` devices joined by `gb_per_s`."""
    n = len(inp.compute_ms)
    bnd = 2 * np.array([transfer_ms(b, gb_per_s, inp.latency_us) for b in inp.cut_bytes])
    A, choice = pipeline_table(_device_stage_time(inp, gb_per_s, devices, 0), bnd, n, devices, 0)
    m = int(np.argmin(A[n - 1, 1:])) + 1
    if not math.isfinite(A[n - 1, m]):
        return DPResult(INF, [])
    stages, base = [], 0
    for i, j, r in _unroll(choice, n - 1, m, 0):
        stages.append((i, j, tuple(range(base, base + r))))
        base += r
    return DPResult(float(A[n - 1, m]), stages)


def solve_hierarchical(inp: DPInput, nodes: int, per_node: int, intra_gb_per_s: float,
                       inter_gb_per_s: float, downstream_extra: int | None = None) -> DPResult:
    """Two levels: level-1 pipelines inside a node for every layer range, then the level-2 DP
    over nodes with those pipelines as its stages' compute. Level-1 memory checks count
    `downstream_extra` devices after the node (default: all other nodes' devices)."""
    if downstream_extra is None:
        downstream_extra = (nodes - 1) * per_node
    n = len(inp.compute_ms)
    bnd1 = 2 * np.array([transfer_ms(b, intra_gb_per_s, inp.latency_us) for b in inp.cut_bytes])
    bnd2 = 2 * np.array([transfer_ms(b, inter_gb_per_s, inp.latency_us) for b in inp.cut_bytes])
    raw1 = _device_stage_time(inp, intra_gb_per_s, per_node, downstream_extra)
    cache: dict[tuple[int, int], np.ndarray] = {}

    def st1(j: int, used: int) -> np.ndarray:  # the same for every start: compute once
        if (j, used) not in cache:
            cache[(j, used)] = raw1(j, used)
        return cache[(j, used)]

    best1 = np.full((n, n), INF)  # best1[i, j]: best in-node pipeline for groups i..j
    inner: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    tables = [pipeline_table(st1, bnd1, n, per_node, i) for i in range(n)]
    for i, (A, choice) in enumerate(tables):
        for j in range(i, n):
            m = int(np.argmin(A[j, 1:])) + 1
            best1[i, j] = A[j, m]
            if math.isfinite(A[j, m]):
                inner[(i, j)] = _unroll(choice, j, m, i)
    W = _prefix(inp.param_bytes)
    r = np.arange(1, nodes + 1, dtype=float)[:, None]

    def stage_time2(j: int, used: int) -> np.ndarray:
        params = (W[j + 1] - W[: j + 1]) / per_node
        sync = allreduce_vec_ms(params[None, :], r, inter_gb_per_s, inp.latency_us) / inp.num_microbatches
        return best1[: j + 1, j][None, :] / r + sync

    A2, choice2 = pipeline_table(stage_time2, bnd2, n, nodes, 0)
    m = int(np.argmin(A2[n - 1, 1:])) + 1
    if not math.isfinite(A2[n - 1, m]):
        return DPResult(INF, [])
    stages, node_base = [], 0
    for i, j, nn in _unroll(choice2, n - 1, m, 0):
        offset = 0
        for a, b, rr in inner[(i, j)]:
            devs = tuple((node_base + q) * per_node + offset + x for q in range(nn) for x in range(rr))
            stages.append((a, b, devs))
            offset += rr
        node_base += nn
    return DPResult(float(A2[n - 1, m]), stages)


def group_bounds(table: LayerTable, max_groups: int) -> list[int]:
    """Layer boundaries [0, ..., L] of at most `max_groups` runs of about equal compute."""
    L = table.num_layers
    if L <= max_groups:
        return list(range(L + 1))
    prefix = np.array(table.fwd_prefix_ms) + np.array(table.bwd_prefix_ms)
    total = prefix[-1]
    if total <= 0:
        cuts = {round(g * L / max_groups) for g in range(1, max_groups)}
    else:
        cuts = {int(np.searchsorted(prefix, g * total / max_groups)) for g in range(1, max_groups)}
    return [0] + sorted(c for c in cuts if 0 < c < L) + [L]


def dp_input(table: LayerTable, bounds: list[int], scale: float, speed: float, num_microbatches: int,
             memory_limit_bytes: float, optimizer: str, schedule: str, latency_us: float) -> DPInput:
    cut = table.cut_bytes()
    comp = [scale * table.compute_ms(a, b) / speed for a, b in zip(bounds, bounds[1:], strict=False)]
    return DPInput(
        compute_ms=np.array(comp),
        param_bytes=np.array([table.param_bytes(a, b) for a, b in zip(bounds, bounds[1:], strict=False)], dtype=float),
        activation_bytes=np.array([scale * table.activation_bytes(a, b)
                                   for a, b in zip(bounds, bounds[1:], strict=False)]),
        cut_bytes=np.array([scale * cut[b - 1] for b in bounds[1:-1]], dtype=float),
        num_microbatches=num_microbatches, memory_limit_bytes=memory_limit_bytes,
        optimizer=optimizer, schedule=schedule, latency_us=latency_us,
    )


def solve_pipedream(profile: Profile, cluster: Cluster, options: PlanOptions, microbatch_size: int,
                    max_groups: int = 48) -> Candidate:
    """PipeDream's DP as a planning method. Hierarchical (devices, then nodes) when the cluster
    has several nodes of equal size; otherwise one level over all devices (intra-node bandwidth
    on one node, inter-node across several). Compute uses the slowest device's speed and memory
    the smallest device's memory."""
    t0 = time.perf_counter()
    table = layer_table(profile)
    devices = cluster.devices()
    specs = cluster.node_specs()
    m = options.global_batch // microbatch_size
    speed = min(d.speed for d in devices)
    limit = min(d.memory_bytes for d in devices)
    bounds = group_bounds(table, max_groups)
    inp = dp_input(table, bounds, microbatch_scale(profile.batch_size, microbatch_size), speed, m,
                   limit, options.optimizer, options.schedule, cluster.latency_us)
    per_node = {s.devices for s in specs}
    check = "local"
    if len(specs) > 1 and len(per_node) == 1:
        d = specs[0].devices
        res = solve_hierarchical(inp, len(specs), d, cluster.intra_node_gb_per_s,
                                 cluster.inter_node_gb_per_s, 0)
        if res.stages and not _fits(table, cluster, options, bounds, res, microbatch_size, m):
            check = "conservative"
            res = solve_hierarchical(inp, len(specs), d, cluster.intra_node_gb_per_s,
                                     cluster.inter_node_gb_per_s, (len(specs) - 1) * d)
    else:
        bw = cluster.intra_node_gb_per_s if len(specs) == 1 else cluster.inter_node_gb_per_s
        res = solve_flat(inp, len(devices), bw)
    if not res.stages:
        raise PipeplanError(
            f"pipedream: no partition fits in device memory ({format_bytes(limit)} per device); "
            f"{_unlimited_need(table, cluster, options, inp, bounds, microbatch_size, m)}"
            "try more devices, a smaller --microbatch-size, --optimizer sgd or --schedule 1f1b")
    return Candidate(_stages(bounds, res), microbatch_size, m, solver={
        "name": "pipedream", "status": "HEURISTIC", "objective": res.objective_ms,
        "wall_s": time.perf_counter() - t0, "groups": len(bounds) - 1, "memory_check": check,
    })


def _stages(bounds: list[int], res: DPResult) -> tuple[StageChoice, ...]:
    """The DP's stages (runs of layer groups) as layer ranges."""
    return tuple(StageChoice(bounds[i], bounds[j + 1], devs) for i, j, devs in res.stages)


def _unlimited_need(table: LayerTable, cluster: Cluster, options: PlanOptions, inp: DPInput,
                    bounds: list[int], microbatch_size: int, m: int) -> str:
    """What the DP's plan would need per device without the memory limit, as a sentence."""
    from dataclasses import replace

    from planner.build import evaluate

    free = replace(inp, memory_limit_bytes=math.inf)
    specs = cluster.node_specs()
    if len(specs) > 1 and len({s.devices for s in specs}) == 1:
        res = solve_hierarchical(free, len(specs), specs[0].devices, cluster.intra_node_gb_per_s,
                                 cluster.inter_node_gb_per_s, 0)
    else:
        res = solve_flat(free, cluster.num_devices, cluster.intra_node_gb_per_s
                         if len(specs) == 1 else cluster.inter_node_gb_per_s)
    ev = evaluate(table, cluster, Candidate(_stages(bounds, res), microbatch_size, m), options)
    return f"its best plan without the limit would need {format_bytes(max(ev.stage_memory_bytes))} per device; "


def _fits(table: LayerTable, cluster: Cluster, options: PlanOptions, bounds: list[int],
          res: DPResult, microbatch_size: int, m: int) -> bool:
    from planner.build import evaluate  # build does not import this module; keep it that way

    return evaluate(table, cluster, Candidate(_stages(bounds, res), microbatch_size, m), options).fits
