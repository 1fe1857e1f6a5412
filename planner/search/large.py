"""A lower bound for instances too large for the round-trip DP of `bound.py` (its cost grows
with layers^2 x devices): a DP over layers only that minimises the devices used, with per-stage
conditions that need no device count (written for the first CP-SAT planner; see
`dp_lower_bound`). Cheaper and looser; where no stage recomputes, its plan is a seed of the
search. Where stages may recompute, a stage meets its conditions plain or recomputed (with
them the 1000-layer chain on 16 devices at 1 GB/s is bounded at 450 ms, not the 251 ms of the
work alone, against a 709-ms plan), and a stage's link out carries what the next stage's
first layer reads from it, a DAG's skips included (ResNet-101 on 128 devices: 411.1 -> 412.9
ms, a 416.1-ms plan). A stage's 1F1B warm-up counts the fewest replicas the layers after it
can have with their own activations in memory (`least_after`): where activations bind, many
more than their static memory alone asks (ResNet-18 on 128 devices, tight memory, b = 32:
89.7 -> 103.3 ms; ResNet-50 141.6 -> 147.8). Its DPs count their work (`layer_dp_work`) in the
bound's share."""

from __future__ import annotations

import math

import numpy as np

from planner.cost import OPTIMIZER_EXTRA_COPIES, LayerTable
from planner.formats import GB, Cluster, PlanOptions
from planner.search.bound import BoundPlan, hop_bytes, least_latency_us, recompute_prefixes


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
                 microbatch_size: int, all_replicas: bool = False, recompute: bool = False,
                 hops: np.ndarray | None = None) -> None:
        L, D = table.num_layers, cluster.num_devices
        m = options.global_batch // microbatch_size
        scale = microbatch_size / table.batch_size
        devices = cluster.devices()
        vmax = max(d.speed for d in devices)
        mem = max(d.memory_bytes for d in devices)
        F = np.array(table.fwd_prefix_ms) * scale / vmax
        B = np.array(table.bwd_prefix_ms) * scale / vmax
        P = np.array(table.param_prefix_bytes, dtype=float)
        # frozen parameters (no gradient): counted once in memory, not all-reduced
        Z = np.zeros(L + 1) if table.frozen_prefix_bytes is None else \
            np.array(table.frozen_prefix_bytes, dtype=float)
        A = np.array(table.activation_prefix_bytes, dtype=float) * scale
        # a recomputed stage keeps at least the tensors its layers read first per microbatch in
        # flight, and while a layer's backward runs, that layer's activations less its inputs
        self.K, self.act_one = recompute_prefixes(table, scale)
        self.recompute = recompute
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
        lat = least_latency_us(cluster) / 1e3
        total = F[L] + B[L]
        # a stage's links, both ways, per replica choice: a stage with at least as many
        # replicas as the largest node has devices cannot share a node with its neighbour, so
        # both its links cross nodes (cost.link_kind); else the fastest link it may use. Into
        # [a, z) at least what layer a reads from layer a - 1; out of it what layer z reads
        # from [a, z) (`bound.hop_bytes`: in a DAG more than the adjacent tensor, e.g. a
        # ResNet block's input to its add), in `ok`
        self.hop = (hop_bytes(table) if hops is None else hops) * scale
        self.gbps = np.where(rs >= per_node, cluster.inter_node_gb_per_s, fast / GB)
        self.lat = lat
        into = np.zeros(L + 1)
        into[1:L] = self.hop[np.arange(L - 1), np.arange(1, L)]
        link = self.both_ways(into[:, None])  # (L + 1, R)

        # static memory after layer z: `cost.static_memory_bytes` (frozen parameters once)
        later_stages = np.ceil(((P[L] - P) * (2 + k) - (Z[L] - Z) * (1 + k)) / mem)  # stages at least
        ar_coef = np.where(rs > 1, 2 * (rs - 1) / rs / bw * 1e3, 0.0)  # per parameter byte
        ar_lat = np.where(rs > 1, 2 * (rs - 1) * lat, 0.0)
        half = link / 2

        # the fewest replicas the layers from z on can have, memory alone (`least_after`): a
        # stage's 1F1B warm-up counts every replica after it, and where activations bind those
        # are many more than the stages the later static memory needs
        if options.schedule != "gpipe":
            later_stages = np.maximum(later_stages, least_after(
                P * (2 + k) - Z * (1 + k), A, self.K if recompute else None,
                self.act_one if recompute else None, m, mem))

        self.options, self.devices, self.vmax = options, devices, vmax
        self.L, self.D, self.m, self.F, self.B, self.P, self.A, self.k = L, D, m, F, B, P, A, k
        self.Z = Z
        self.rs, self.mk, self.mem, self.total, self.link, self.half = rs, mk, mem, total, link, half
        self.rh = rh
        self.later_stages, self.ar_coef, self.ar_lat = later_stages, ar_coef, ar_lat

    def both_ways(self, nbytes: np.ndarray) -> np.ndarray:
        """A transfer of `nbytes` (..., 1) and its gradient back, per replica choice (..., R)."""
        return np.where(nbytes > 0, 2 * (nbytes / (self.gbps * GB) * 1e3 + self.lat), 0.0)

    def ok(self, T: float, z: int, dp: np.ndarray) -> np.ndarray:
        """(z, R) booleans: stage [a, z) on rs[i] replicas meets every condition at T, given
        dp[a] (fewest devices the layers before a can use at T)."""
        (L, D, m, F, B, P, A, k, rs, mk, mem, total, link, half, later_stages, ar_coef,
         ar_lat) = (self.L, self.D, self.m, self.F, self.B, self.P, self.A, self.k, self.rs,
                    self.mk, self.mem, self.total, self.link, self.half, self.later_stages,
                    self.ar_coef, self.ar_lat)
        options = self.options
        a = np.arange(z)
        frozen = self.Z[z] - self.Z[a]
        params = P[z] - P[a] - frozen  # the all-reduced ones
        # in flight on replica 0: ceil(min(m, U) / r), U = replicas from here to the end,
        # at least r plus one device per `mem` of the later layers' static memory
        if options.schedule == "gpipe":
            inflight = mk[None, :]
        else:
            later = later_stages[z]
            inflight = np.ceil(np.minimum(m, self.rh[None, :] + later) / self.rh[None, :])
        ar = params[:, None] * ar_coef[None, :] + ar_lat[None, :]  # (z, R)
        # 1F1B warm-up w <= ceil(min(m, U) / r) with U <= D - dp[a]: the devices left
        # after the fewest the layers before can use at this T
        left = np.where(np.isfinite(dp[a]), D - dp[a], D)
        w_hi = np.minimum(mk[None, :], np.ceil(np.minimum(m, np.maximum(left, 1))[:, None]
                                               / rs[None, :]))
        if options.schedule == "gpipe":
            w_hi = mk[None, :] + 0 * w_hi
        out = self.both_ways(self.hop[:z, z][:, None]) if z < L else np.zeros((z, len(rs)))
        fwd = (F[z] - F[a])[:, None]
        static = ((P[z] - P[a]) * (2 + k) - frozen * (1 + k))[:, None]
        ok = np.zeros((z, len(rs)), dtype=bool)
        # plain, and where stages may recompute, recomputed: its forward once more in its
        # backward, its layers' inputs kept and one layer's activations while it runs
        for again, kept in ((0.0, (A[z] - A[a])[:, None] * inflight),) + (
                ((1.0, (self.K[z] - self.K[a])[:, None] * inflight
                  + np.maximum.accumulate(self.act_one[:z][::-1])[::-1][:, None]),)
                if self.recompute else ()):
            bwd = (B[z] - B[a])[:, None] + again * fwd
            # P1: first forward in, the stage busy, then the backward out or its all-reduce
            p1 = F[a][:, None] + half[a] + mk[None, :] * (fwd + bwd) \
                + np.maximum(ar, B[a][:, None] + half[a])
            # the first microbatch's round trip, then the stage's remaining backwards
            p2 = total + again * fwd + link[a] + out + (mk[None, :] - 1) * bwd \
                + (mk[None, :] - w_hi) * fwd
            # the last microbatch through this stage's replica, to the end and back, then
            # this stage's all-reduce
            p3 = F[L] + (mk[None, :] - 1) * fwd + (mk[None, :] - w_hi) * bwd \
                + (B[L] - B[a])[:, None] + again * fwd + half[a] + out + ar
            ok |= (p1 <= T) & (p2 <= T) & (p3 <= T) & (static + kept <= mem)
        return ok


def least_after(static: np.ndarray, act: np.ndarray, kept_rc: np.ndarray | None,
                act_one: np.ndarray | None, m: int, mem: float) -> np.ndarray:
    """(L + 1,): for each z, the fewest replicas (one device each at least) over the stages
    that hold layers [z, L) in any plan whose every stage fits memory (inf: none fits).

    A stage [z, y) with r replicas and d replicas after it holds, on its busiest replica,
    `min(ceil(m / r), ceil((r + d) / r))` microbatches in flight (1F1B's warm-up,
    `cost.warmup_1f1b`) of `act[y] - act[z]` bytes each, plus its static memory
    `static[y] - static[z]` (prefix sums); recomputed (where `kept_rc` is given), each keeps
    `kept_rc[y] - kept_rc[z]` and a backward one layer's `act_one` more. Fewer replicas after
    it hold fewer in flight, so with d the fewest the layers from y on can have, the least r
    that fits gives the fewest from z: by induction no plan's stages from z on have fewer."""
    L = len(static) - 1
    out = np.full(L + 1, np.inf)
    out[L] = 0.0
    for z in range(L - 1, -1, -1):
        y = np.arange(z + 1, L + 1)
        d = out[y]
        room = mem - (static[y] - static[z])
        variants = [(act[y] - act[z], room)]
        if kept_rc is not None and act_one is not None:
            # one layer's activations while a backward runs: at least the largest of [z, y)
            one = np.maximum.accumulate(act_one[z:])
            variants.append((kept_rc[y] - kept_rc[z], room - one))
        best = np.full(len(y), np.inf)
        for per_mb, left in variants:
            with np.errstate(divide="ignore", invalid="ignore"):  # inf / inf where nothing fits
                cap = np.where(per_mb > 0, np.floor(left / np.where(per_mb > 0, per_mb, 1.0)), np.inf)
                ok = (left >= 0) & (cap >= 1) & np.isfinite(d)
                # in flight <= cap: r >= m / cap, or (1 + d / r <= cap) r >= d / (cap - 1)
                by_m = np.ceil(m / np.maximum(cap, 1.0))  # m / inf = 0: any r
                by_d = np.where(d <= 0, 1.0, np.where(cap >= 2, np.ceil(d / np.maximum(cap - 1, 1)), np.inf))
                r = np.maximum(1.0, np.minimum(by_m, by_d))
            best = np.minimum(best, np.where(ok, r, np.inf))
        out[z] = float(np.min(best + d)) if len(y) else np.inf
    return out


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
                   max_steps: int = 30, recompute: bool = False, max_work: float = math.inf,
                   hops: np.ndarray | None = None) -> tuple[BoundPlan | None, int]:
    """The smallest T for which some split and replica vector (at most D devices) satisfies,
    for every stage [a, z) with r replicas, on the fastest devices with the largest memory:

    - `Fpre(a) + ceil(m / r) C(a, z) + max(AR(a, z, r), Bpre(a)) <= T` (the stage's rank busy
      all the time, after the first forward reached it and before the backwards left for the
      earlier stages or its all-reduce: path P1 of `model.py`),
    - `C(0, L) + (ceil(m / r) - 1) Bwd(a, z) + (ceil(m / r) - w) Fwd(a, z) <= T` (the first
      microbatch's round trip, then the stage's steady state and remaining backwards; plus the
      stage's own two links both ways, inter-node when the stage has at least as many
      replicas as the largest node has devices: into it the tensor layer a - 1 gives layer a,
      out of it every tensor of [a, z) that layer z reads), with `w` an upper bound of its
      1F1B warm-up:
      `ceil(min(m, D - dp(a)) / r)`, `dp(a)` the fewest devices the layers before can use,
    - `Fwd(0, L) + (ceil(m / r) - 1) Fwd(a, z) + (ceil(m / r) - w) Bwd(a, z) + Bwd(a, L)
      + AR(a, z, r) <= T` (the replica's last microbatch reaches it after its other forwards
      and steady-state backwards, goes to the end and back, then the stage all-reduces),
    - its parameters, gradients, optimizer state and `ceil(min(m, r + n) / r)` microbatches of
      activations fit (1F1B's in-flight count, with `n` the fewest replicas the later layers
      can have: `least_after`, their memory alone, activations with their own warm-ups
      included; at least the stages their static memory needs).

    Every plan satisfies these at its own iteration time (communication only adds), so the
    result is a lower bound of the optimum; bisection to `rel_tol` or `max_steps` (the bound
    stays valid, only looser), and the work spent (`layer_dp_work` per DP; it stops before
    passing `max_work`, with the bound so far). A bound of inf (no plan, `seed` False): memory
    admits none at any time. None: not two DPs in `max_work`. With `recompute` (stages may
    recompute), a stage meets the conditions plain or recomputed (its forward once more in its
    backward; its layers' inputs kept and one layer's activations while it runs). `hops`: `bound.hop_bytes(table)`, if the caller has it.
    """
    sb = StageBounds(table, cluster, options, microbatch_size, recompute=recompute, hops=hops)
    step = layer_dp_work(sb.L, len(sb.rs), recompute)
    spent = 0
    if 2 * step > max_work:
        return None, 0

    def feasible(T: float):
        nonlocal spent
        spent += step
        return _dp_plan(sb, T)

    def affords() -> bool:
        return spent + step <= max_work

    # memory alone admits no plan (every condition but memory holds at T = inf): no plan of
    # this microbatch size fits, a bound of inf (without it, T doubled until the work ran out
    # and the size kept the bound that needs no DP, which then was the planner's)
    no_plan = BoundPlan(math.inf, (), (), seed=False)
    lo = max(sb.m * sb.total * sb.vmax / sum(d.speed for d in sb.devices), sb.total)
    hi = max(upper_ms, lo)
    if math.isfinite(hi):
        plan = feasible(hi)
        if plan is None:
            return (no_plan if affords() and feasible(math.inf) is None else None), spent
    else:  # no plan known: double from lo until one meets the conditions (below it none does)
        if feasible(math.inf) is None:
            return no_plan, spent
        hi, start = 2 * lo, lo
        while (plan := feasible(hi)) is None:
            if not affords() or hi > start * 2 ** 30:
                return None, spent
            lo, hi = hi, 2 * hi
    if affords() and (low_plan := feasible(lo)) is not None:
        hi, plan = lo, low_plan
    for _ in range(max_steps):
        if hi - lo <= rel_tol * hi or not affords():
            break
        mid = (lo + hi) / 2
        mid_plan = feasible(mid)
        if mid_plan is not None:
            hi, plan = mid, mid_plan
        else:
            lo = mid
    return _bound_plan(lo, plan), spent


def _bound_plan(bound_ms: float, plan: tuple[list[int], list[int]]) -> BoundPlan:
    return BoundPlan(float(bound_ms), tuple(int(x) for x in plan[0]), tuple(int(x) for x in plan[1]))


# The work of one `_dp_plan` (in the search's units, `planner.search.local.Budget`, about 7 us
# each): ~7 per layer and one per 310 (stage start, stage end, replica choice) cells, fitted on
# 176- to 1250-layer profiles on our 2-core machine (11-189 ms per DP); 1.75x with recomputed
# stages (two sets of conditions per cell)
LAYER_DP_ITER_WORK = 7.0
LAYER_DP_CELL_WORK = 1 / 310
RECOMPUTE_DP_FACTOR = 1.75


def layer_dp_work(num_layers: int, choices: int, recompute: bool) -> int:
    work = LAYER_DP_ITER_WORK * num_layers + LAYER_DP_CELL_WORK * num_layers * (num_layers + 1) / 2 * choices
    return int(work * (RECOMPUTE_DP_FACTOR if recompute else 1.0)) + 1
