"""A lower bound for instances too large for the round-trip DP of `bound.py` (its cost grows
with layers^2 x devices): a DP over layers only that minimises the devices used, with per-stage
conditions that need no device count (written for the first CP-SAT planner; see
`dp_lower_bound`). Cheaper and looser; its plan is a seed of the search."""

from __future__ import annotations

import numpy as np

from planner.cost import OPTIMIZER_EXTRA_COPIES, LayerTable, transfer_ms
from planner.formats import GB, Cluster, PlanOptions
from planner.search.bound import BoundPlan


def adjacent_bytes(table: LayerTable) -> list[int]:
    """`out[z]` = bytes of the tensors produced by layer z-1 and used by layer z: they cross
    any stage boundary at z into the very next stage, so they bound its traffic from below."""
    out = [0] * (table.num_layers + 1)
    for t in table.tensors:
        if t.producer >= 0 and t.producer + 1 in t.consumers:
            out[t.producer + 1] += t.nbytes
    return out


def replica_choices(m: int, max_r: int) -> np.ndarray:
    """For each distinct ceil(m / r), the smallest r giving it (all-reduce grows with r, and
    it uses the fewest devices; memory is priced with the largest r, `StageBounds`)."""
    out, seen = [], set()
    for r in range(1, max_r + 1):
        k = -(-m // r)
        if k not in seen:
            seen.add(k)
            out.append(r)
    return np.array(out, dtype=float)


class StageBounds:
    """The per-stage conditions of `dp_lower_bound` at a target time T (internal)."""

    def __init__(self, table: LayerTable, cluster: Cluster, options: PlanOptions,
                 microbatch_size: int, all_replicas: bool = False) -> None:
        L, D = table.num_layers, cluster.num_devices
        m = options.global_batch // microbatch_size
        scale = microbatch_size / table.batch_size
        devices = cluster.devices()
        vmax = max(d.speed for d in devices)
        mem = max(d.memory_bytes for d in devices)
        F = np.array(table.fwd_prefix_ms) * scale / vmax
        B = np.array(table.bwd_prefix_ms) * scale / vmax
        P = np.array(table.param_prefix_bytes, dtype=float)
        A = np.array(table.activation_prefix_bytes, dtype=float) * scale
        k = OPTIMIZER_EXTRA_COPIES[options.optimizer]
        rs = np.arange(1, D + 1, dtype=float) if all_replicas else replica_choices(m, D)
        mk = np.ceil(m / rs)
        # memory is priced with the largest r of each n: it holds the fewest in flight, so a
        # stage with any r of that n fits if one does (the smallest r alone did not: r = 5
        # can fit where r = 4 cannot, with the same n = 4 of m = 16)
        every = np.arange(1, D + 1, dtype=float)
        rh = np.array([every[np.ceil(m / every) == k].max() for k in mk])
        # a stage with more replicas than the largest node has devices spans nodes (inter-node)
        per_node = max(s.devices for s in cluster.node_specs())
        fast = (max(cluster.intra_node_gb_per_s, cluster.inter_node_gb_per_s) if per_node > 1
                else cluster.inter_node_gb_per_s) * GB  # one device per node: every link crosses
        bw = np.where(rs <= per_node, fast, cluster.inter_node_gb_per_s * GB)
        lat = cluster.latency_us / 1e3
        total = F[L] + B[L]
        # the stage's own links, both ways (adjacent tensors), at the fastest bandwidth it may use
        adj = adjacent_bytes(table)
        def both_ways(gbps: float) -> np.ndarray:
            return np.array([0.0 if z in (0, L) else
                             2 * transfer_ms(scale * adj[z], gbps, cluster.latency_us)
                             for z in range(L + 1)])

        # a stage with at least as many replicas as the largest node has devices cannot share a
        # node with its neighbour: both its links cross nodes (cost.link_kind), (L + 1, R)
        link = np.where(rs[None, :] >= per_node, both_ways(cluster.inter_node_gb_per_s)[:, None],
                        both_ways(fast / GB)[:, None])

        later_stages = np.ceil((P[L] - P) * (2 + k) / mem)  # stages at least, after layer z
        ar_coef = np.where(rs > 1, 2 * (rs - 1) / rs / bw * 1e3, 0.0)  # per parameter byte
        ar_lat = np.where(rs > 1, 2 * (rs - 1) * lat, 0.0)
        half = link / 2

        self.options, self.devices, self.vmax = options, devices, vmax
        self.L, self.D, self.m, self.F, self.B, self.P, self.A, self.k = L, D, m, F, B, P, A, k
        self.rs, self.mk, self.mem, self.total, self.link, self.half = rs, mk, mem, total, link, half
        self.rh = rh
        self.later_stages, self.ar_coef, self.ar_lat = later_stages, ar_coef, ar_lat

    def ok(self, T: float, z: int, dp: np.ndarray) -> np.ndarray:
        """(z, R) booleans: stage [a, z) on rs[i] replicas meets every condition at T, given
        dp[a] (fewest devices the layers before a can use at T)."""
        (L, D, m, F, B, P, A, k, rs, mk, mem, total, link, half, later_stages, ar_coef,
         ar_lat) = (self.L, self.D, self.m, self.F, self.B, self.P, self.A, self.k, self.rs,
                    self.mk, self.mem, self.total, self.link, self.half, self.later_stages,
                    self.ar_coef, self.ar_lat)
        options = self.options
        a = np.arange(z)
        comp = (F[z] - F[a]) + (B[z] - B[a])  # (z,)
        params = P[z] - P[a]
        # in flight on replica 0: ceil(min(m, U) / r), U = replicas from here to the end,
        # at least r plus one device per `mem` of the later layers' static memory
        if options.schedule == "gpipe":
            inflight = mk[None, :]
        else:
            later = later_stages[z]
            inflight = np.ceil(np.minimum(m, self.rh[None, :] + later) / self.rh[None, :])
        fits = (params * (2 + k))[:, None] + (A[z] - A[a])[:, None] * inflight <= mem
        ar = params[:, None] * ar_coef[None, :] + ar_lat[None, :]  # (z, R)
        # P1: first forward in, the stage busy, then the backward out or its all-reduce
        p1 = F[a][:, None] + half[a] + mk[None, :] * comp[:, None] \
            + np.maximum(ar, B[a][:, None] + half[a])
        # the first microbatch's round trip, then the stage's remaining backwards
        # 1F1B warm-up w <= ceil(min(m, U) / r) with U <= D - dp[a]: the devices left
        # after the fewest the layers before can use at this T
        left = np.where(np.isfinite(dp[a]), D - dp[a], D)
        w_hi = np.minimum(mk[None, :], np.ceil(np.minimum(m, np.maximum(left, 1))[:, None]
                                               / rs[None, :]))
        if options.schedule == "gpipe":
            w_hi = mk[None, :] + 0 * w_hi
        p2 = total + link[a] + link[z][None, :] + (mk[None, :] - 1) * (B[z] - B[a])[:, None] \
            + (mk[None, :] - w_hi) * (F[z] - F[a])[:, None]
        # the last microbatch through this stage's replica, to the end and back, then
        # this stage's all-reduce
        p3 = F[L] + (mk[None, :] - 1) * (F[z] - F[a])[:, None] \
            + (mk[None, :] - w_hi) * (B[z] - B[a])[:, None] \
            + (B[L] - B[a])[:, None] + half[a] + link[z][None, :] + ar
        ok = (p1 <= T) & (p2 <= T) & (p3 <= T) & fits
        return ok


def _dp_plan(sb: StageBounds, T: float) -> tuple[list[int], list[int]] | None:
    """A split and replica vector meeting every per-stage condition at T on at most D devices
    (the fewest devices), or None: no plan finishes within T."""
    L, D, rs = sb.L, sb.D, sb.rs
    dp = np.full(L + 1, np.inf)
    dp[0] = 0
    arg = np.zeros(L + 1, dtype=int)
    rarg = np.zeros(L + 1, dtype=int)
    for z in range(1, L + 1):
        a = np.arange(z)
        ok = sb.ok(T, z, dp)
        cost = np.where(ok, rs[None, :], np.inf)  # (z, R)
        best_r = np.argmin(cost, axis=1)
        cand = dp[a] + cost[a, best_r]
        i = int(np.argmin(cand))
        dp[z] = cand[i]
        arg[z], rarg[z] = i, int(rs[best_r[i]])
    if not dp[L] <= D:
        return None
    bounds, reps, z = [L], [], L
    while z > 0:
        reps.append(int(rarg[z]))
        z = int(arg[z])
        bounds.append(z)
    return bounds[::-1], reps[::-1]


def dp_lower_bound(table: LayerTable, cluster: Cluster, options: PlanOptions,
                   microbatch_size: int, upper_ms: float, rel_tol: float = 2e-3,
                   max_steps: int = 30) -> BoundPlan | None:
    """The smallest T for which some split and replica vector (at most D devices) satisfies,
    for every stage [a, z) with r replicas, on the fastest devices with the largest memory:

    - `Fpre(a) + ceil(m / r) C(a, z) + max(AR(a, z, r), Bpre(a)) <= T` (the stage's rank busy
      all the time, after the first forward reached it and before the backwards left for the
      earlier stages or its all-reduce: path P1 of `model.py`),
    - `C(0, L) + (ceil(m / r) - 1) Bwd(a, z) + (ceil(m / r) - w) Fwd(a, z) <= T` (the first
      microbatch's round trip, then the stage's steady state and remaining backwards; plus the
      stage's own two links both ways, inter-node when the stage has at least as many
      replicas as the largest node has devices), with `w` an upper bound of its 1F1B warm-up:
      `ceil(min(m, D - dp(a)) / r)`, `dp(a)` the fewest devices the layers before can use,
    - `Fwd(0, L) + (ceil(m / r) - 1) Fwd(a, z) + (ceil(m / r) - w) Bwd(a, z) + Bwd(a, L)
      + AR(a, z, r) <= T` (the replica's last microbatch reaches it after its other forwards
      and steady-state backwards, goes to the end and back, then the stage all-reduces),
    - its parameters, gradients, optimizer state and `ceil(min(m, r + n) / r)` microbatches of
      activations fit (1F1B's in-flight count, with `n` the least number of later stages that
      can hold the later layers' static memory).

    Every plan satisfies these at its own iteration time (communication only adds), so the
    result is a lower bound of the optimum; bisection to `rel_tol` or `max_steps` (the bound
    stays valid, only looser). None: nothing fits."""
    sb = StageBounds(table, cluster, options, microbatch_size)

    def feasible(T: float):
        return _dp_plan(sb, T)

    lo = max(sb.m * sb.total * sb.vmax / sum(d.speed for d in sb.devices), sb.total)
    hi = max(upper_ms, lo)
    plan = feasible(hi)
    if plan is None:
        return None
    low_plan = feasible(lo)
    if low_plan is not None:
        hi, plan = lo, low_plan
    for _ in range(max_steps):
        if hi - lo <= rel_tol * hi:
            break
        mid = (lo + hi) / 2
        mid_plan = feasible(mid)
        if mid_plan is not None:
            hi, plan = mid, mid_plan
        else:
            lo = mid
    return BoundPlan(float(lo), tuple(int(x) for x in plan[0]), tuple(int(x) for x in plan[1]))
