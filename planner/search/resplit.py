"""Compound moves for tight memory: new replica counts, then the stage boundaries that suit them.

Where memory binds, giving the slowest stage another replica deepens the 1F1B warm-up of
every stage before it (`warmup_1f1b`), so they overflow unless their boundaries move too: a
dozen single moves, each of which alone overflows (gnmt_large on 4 x 4 devices at 10 / 1 GB/s,
tight memory: 2654.7 ms, every single move from there no faster; the same replica counts
with the boundaries re-split: 1679.4 ms). `resplit_moves` proposes such plans: per replica
vector (the structure's own; the busiest stage with one replica more, from an idle device
or from the least busy stage; one more single-replica stage after the busiest), the
boundaries that minimise the busiest replica's compute (n_k x forward + backward, recomputed
where only that fits; and once more with every microbatch's transfers in and out added, on
the slowest link) with every stage within memory as the schedule holds it. Proxies (no
all-reduces, no placement): `evaluate()` scores what they propose.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from planner.cost import OPTIMIZER_EXTRA_COPIES, microbatch_scale, transfer_ms, warmup_1f1b
from planner.formats import crossing_bytes
from planner.search.space import Evaluator, Structure

MAX_LAYERS = 400  # above this many layers the DP (stages x layers^2 cells) is not run


def _tables(ev: Evaluator, b: int) -> dict[str, np.ndarray]:
    """Prefix sums at microbatch size `b`, and per stage [i, j) what its recomputation keeps
    (`LayerTable.recompute_bytes`, as (L+1, L+1) tables: kept bytes and the one block's peak)."""
    key = ("resplit", b)
    got = ev.cache_extra.get(key)
    if got is None:
        t = ev.table
        L = t.num_layers
        scale = microbatch_scale(t.batch_size, b)
        # kept[i, j]: tensors some layer in [i, j) reads; a tensor read by c_1 < ... < c_q counts
        # for the rows i in (c_(k-1), c_k] from column c_k + 1 on
        diff = np.zeros((L + 1, L + 2))
        for x in t.tensors:
            lo = 0
            for c in sorted(set(x.consumers)):
                diff[lo:c + 1, c + 1] += x.nbytes
                lo = c + 1
        kept = np.cumsum(diff, axis=1)[:, :L + 1]
        kept[:, L] += t.loss_activation_bytes
        own = np.array(t.saved_input_bytes or [0] * L, dtype=float)
        layer = np.diff(np.array(t.activation_prefix_bytes, dtype=float)) - own
        layer[-1:] -= t.loss_activation_bytes
        peak = np.zeros((L + 1, L + 1))
        for i in range(L):
            peak[i, i + 1:] = np.maximum(np.maximum.accumulate(layer[i:]), 0.0)
        # the transfer across each cut (after layer i - 1), on the slowest link: a comm proxy
        spans = [(x.producer, max(x.consumers), x.nbytes) for x in t.tensors if x.producer >= 0]
        cut = np.zeros(L + 1)
        cut[1:L] = crossing_bytes(spans, L)
        c = ev.cluster
        gbps = min(c.inter_node_gb_per_s, c.intra_node_gb_per_s)
        hop = np.array([transfer_ms(x * scale, gbps, c.latency_us) for x in cut])
        got = ev.cache_extra[key] = {
            "X": hop,
            "F": np.array(t.fwd_prefix_ms) * scale,
            "C": (np.array(t.fwd_prefix_ms) + np.array(t.bwd_prefix_ms)) * scale,
            "P": np.array(t.param_prefix_bytes, dtype=float),
            "Z": np.zeros(L + 1) if t.frozen_prefix_bytes is None else np.array(t.frozen_prefix_bytes, dtype=float),
            "A": np.array(t.activation_prefix_bytes, dtype=float) * scale,
            "K": kept * scale, "T": peak * scale,
            "W": t.loss_workspace_bytes * scale}  # the loss's backward, on the last stage
    return got


def resplit(ev: Evaluator, b: int, replicas: list[int], hops: bool = False) -> tuple[int, ...] | None:
    """Boundaries (0, ..., L) for stages with these replica counts (in order) minimising the
    busiest replica's compute, each stage within memory (its parameters, gradients and
    optimizer state, and the microbatches the schedule keeps in flight on it; recomputed,
    the tensors its layers read and one layer's activations); None if no split fits."""
    t, opts = ev.table, ev.options
    L, S = t.num_layers, len(replicas)
    if S > L:
        return None
    p = _tables(ev, b)
    m = opts.global_batch // b
    limit = min(d.memory_bytes for d in ev.devices)
    speed = max(d.speed for d in ev.devices)
    coef = 2 + OPTIMIZER_EXTRA_COPIES[opts.optimizer]
    i, j = np.triu_indices(L + 1, 1)  # every stage [i, j)
    comp = (p["C"][j] - p["C"][i]) / speed
    busy = comp > 0 if t.compute_ms(0, L) > 0 else np.ones_like(comp, dtype=bool)  # no 0-ms stage
    if hops:  # every microbatch waits for its transfers in and out (1F1B does not hide them)
        comp = comp + p["X"][i] + p["X"][j]
    fwd = (p["F"][j] - p["F"][i]) / speed
    static = (p["P"][j] - p["P"][i]) * coef - (p["Z"][j] - p["Z"][i]) * (coef - 1)  # frozen: once
    act, kept, transient = p["A"][j] - p["A"][i], p["K"][i, j], p["T"][i, j]
    loss_ws = np.where(j == L, p["W"], 0.0)
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((S, L + 1), dtype=int)
    for k, r in enumerate(replicas):
        n = -(-m // r)
        w = n if opts.schedule == "gpipe" else warmup_1f1b(m, replicas, k, 0)
        plain = static + w * act + loss_ws <= limit
        recomputed = static + w * kept + transient + loss_ws <= limit if opts.allow_recompute else np.zeros_like(plain)
        cost = np.where(plain, n * comp, np.where(recomputed, n * (comp + fwd), np.inf))
        cost = np.where(busy, cost, np.inf)
        grid = np.full((L + 1, L + 1), np.inf)
        grid[i, j] = np.maximum(best[i], cost)
        choice[k] = np.argmin(grid, axis=0)
        best = grid[choice[k], np.arange(L + 1)]
    if not np.isfinite(best[L]):
        return None
    bounds = [L]
    for k in range(S - 1, -1, -1):
        bounds.append(int(choice[k, bounds[-1]]))
    return tuple(reversed(bounds))


def resplit_moves(st: Structure, ev: Evaluator) -> Iterator[Structure]:
    """The structure re-split for its own replica counts and for a few others (module
    docstring). Structures with tensor-parallel stages are left alone."""
    if st.tp and any(x > 1 for x in st.tp) or ev.table.num_layers > MAX_LAYERS:
        return
    b, r = st.microbatch_size, list(st.replicas)
    m = ev.options.global_batch // b
    comp = [-(-m // x) * ev.table.compute_ms(a, z) for a, z, x in zip(st.bounds[:-1], st.bounds[1:], r, strict=True)]
    hot = max(range(len(r)), key=lambda k: comp[k])
    cold = min(range(len(r)), key=lambda k: comp[k])
    free = ev.cluster.num_devices - st.num_devices
    vectors = [r]
    if free >= 1:
        vectors.append(r[:hot] + [r[hot] + 1] + r[hot + 1:])
        vectors.append(r[:hot + 1] + [1] + r[hot + 1:])
    if cold != hot and r[cold] >= 2:
        v = r.copy()
        v[hot] += 1
        v[cold] -= 1
        vectors.append(v)
    for k in range(len(r) - 1):  # two adjacent stages as one on both their replicas
        vectors.append(r[:k] + [r[k] + r[k + 1]] + r[k + 2:])
    for k in range(len(r)):  # a stage as two, its replicas shared out (or one more for the second)
        if r[k] >= 2:
            vectors.append(r[:k] + [r[k] - r[k] // 2, r[k] // 2] + r[k + 1:])
        elif free >= 1:
            vectors.append(r[:k] + [1, 1] + r[k + 1:])
    seen = {(st.bounds, st.replicas)}
    for v in vectors:
        for hops in (False, True):
            ev.work += ev.table.num_layers ** 2 * len(v) // 256 + 1  # the DP's cells (budgeted)
            bounds = resplit(ev, b, v, hops)
            if bounds is not None and (bounds, tuple(v)) not in seen:
                seen.add((bounds, tuple(v)))
                yield st.with_stages(bounds, v)
