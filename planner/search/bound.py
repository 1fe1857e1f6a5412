"""A lower bound on the simulated iteration time of every plan, and the plan that attains it,
by dynamic programming over (first layer of a suffix of stages, devices it uses).

Alpa's inter-operator pass (Zheng et al., OSDI 2022) bounds a pipeline by its slowest stage;
that bound is tight when compute dominates and loose when transfers do, because 1F1B keeps
only `w` microbatches in flight on a stage: the next forward waits for a backward that went
to the end of the pipeline and back. For every stage k of a plan (layers [i, j), r replicas,
n = ceil(m / r) microbatches on its busiest replica, per-microbatch compute C, warm-up w)
two conditions hold at the plan's simulated time T:

    work:        H(i) + n C                 + max(Tl(i), AR) <= T
    round trip:  H(i) + ceil(n / w) RT_k    + max(Tl(i), AR) <= T

where H(i) is the earliest its first forward can start (the forward time of the layers before
it and the smallest transfer into layer i), Tl(i) the backward time of the layers before it
plus that transfer, AR its gradient all-reduce, and RT_k = C + 2 x_k + RT_{k+1} the round trip
of one microbatch from this stage to the end of the pipeline and back (x_k the transfer of the
tensors the stage sends to the first layer of the next stage). In 1F1B the forward of the
replica's microbatch q + w follows the backward of its microbatch q, so consecutive groups of
w microbatches are a round trip apart; in GPipe w = n and the condition is the work one.

Everything is priced optimistically so the bound holds for every placement: the fastest
device, the largest memory, and links by node groups. A hop is inside a node only if both
stages' devices share one, so a run of such hops keeps its stages on one node: the DP's state
carries the devices of the suffix's first group (at most a node's), and a stage joins it over
a fast link only if it fits, else it starts a group of its own behind a slow link. Every
placement is one path of this DP. (Without groups a hop was fast whenever its stage and one
more device fit a node: 4 stages of 1 device on 4 x 4 devices then never crossed a node; that
cheaper DP bisects first, and its bound is where the grouped one starts.) RT_{k+1} only makes
the conditions of stage k harder, so the smallest suffix round trip is all the DP keeps per
(i, devices, group): the DP is exact for these conditions, bisection on T gives the smallest
T some split and replica vector satisfies, and that split is a candidate plan as well.

After the search, `tighten` bisects once more between that bound and the best plan found,
with two cross-stage conditions (`Conditions.cross_stage`): a stage's last backward ends no
earlier than its successor's plus the hop back and its own B, Z_k >= max(H(i) + its own busy
time, Z_{k+1} + x_k + B_k), and Z_k + max(Tl(i), AR) <= T (a replicated stage cannot start a
long all-reduce before the slowest stage after it has done every microbatch; the DP keeps
the smallest Z of a suffix beside its smallest round trip, each minimised on its own); and in
a DAG, a tensor sent past the next stage adds its own round trip (`skip_round_trips`). They
stay out of the first bisection, whose plans seed the search: a different seed moves where
the local search ends, better on some instances and worse on others. With them, too, H(i) and
Tl(i) count every hop before layer i, not only the one into it: a prefix DP finds the least
hop sum of the stages before layer i that meet their own conditions (`_prefix_hops`). Where
memory or time forces the layers before a slow stage into several stages on slow links, the
first microbatch reaches it, and the last gradient leaves it, only through all of those hops
(vgg16 on 16 devices at 1 GB/s, tight memory: 26.7 % -> 1.9 %). The prefix DP knows how many
devices the stages from layer i on have, so a prefix stage holds its whole 1F1B warm-up (one
microbatch per replica after it, per replica of its own), and its hops are priced by node
groups like the suffix's (AlexNet on 4 x 4 devices, tight memory: 746.6 -> 867.7 ms with the
devices after, -> 953.9 with the groups too, against a plan of 968.7).

Two more cross-stage quantities follow the first and the last microbatch through the stages
after a stage, each also minimised on its own per state. The first microbatch's backward on a
stage waits for the stage's own 1F1B warm-up forwards (at least the fewest any of its replica
counts runs, `inflight`), not only for the round trip: U_k = max(RT_k, w F_k + B_k, F_k + B_k +
2 x_k + U_{k+1}); the stage's first backward ends no earlier than H(i) + U_k, and its last
forward starts no earlier than U_k + (n - 1 - w)(F + B) after H(i) where w < n. The last
microbatch, m - 1, is the last of a busiest replica (round robin), so its forward starts on
each stage no earlier than that replica's last round, and every stage after it waits for it:
Y_k = max(RT_k + max(Tl(i), AR_k), F_k + x_k + Y_{k+1}), and T >= (its start) + F_k + x_k +
Y_{k+1}: a replicated stage's all-reduce after the last microbatch has come down the whole
pipeline behind the first stages' round trips (a 100-layer chain on 16 devices at 1 GB/s:
a plan whose last stage of 3 layers on 11 replicas meets the conditions above at 116 ms and
simulates to 183). On 54 small instances with an exhaustive optimum they raise the tightened
bound by more than 1 % on 19, and to within 1 % of the optimum on 21 (17 before). On the real
profiles they move it less (unlimited tightening: chain100 4 x 4 tight 96.4 -> 98.4 ms, GNMT
2 x 8 tight 156.2 -> 168.0, the chain above 116.1 -> 118.3 on 16 x 1): minimised apart from the
round trip, the least Y of a suffix comes from one without the expensive all-reduce, the
least RT from another. They cost 1.4x a step (`Conditions.microbatch_paths`), so `tighten`
takes them only where its work affords the steps to prove the 1 % with them (taken on every
step, the fewer steps lost more than they gained: inception_v3 on 4 x 4 devices, tight,
3219.5 -> 1925.8 ms).

Last, on the work `tighten` has left, the same with each microbatch's last backward on its own
(`Conditions.per_microbatch`): microbatch q runs on replica q mod r of every stage (in order),
so the backward of q on stage k ends no earlier than E_{k+1}(q) + x_k + B_k, where E_{k+1}(q)
is when it ended on the next stage, and no earlier than H(i) + (floor(q / r) + 1)(F + B), the
work of q's replica up to q; and that replica runs the backward of q and of every later
microbatch it has before the layers before it and the all-reduce can end:
T >= E_{k+1}(q) + x_k + (its microbatches from q on) B_k + max(Tl(i), AR). The DP keeps, per
suffix, the least E of each q on its own (a relaxation: each entry may come from a different
suffix), priced per replica count (the least over the counts of one n). Where tight memory
leaves a replicated stage few microbatches, the one that sets the time is often not the last
(the GPT example, 16 devices, tight: 857.9 -> 927.6 ms against the 932.7 optimum). A step
costs about m / 2 steps without it, so it runs only after that bisection has ended. Each
microbatch's condition stands on its own, so tracking a few is a relaxation too
(`Conditions.tracked`): `prove` tests 1 % below the plan with the last microbatch alone, then
four, then all (chain100 on 2 x 8 devices: all 16 prove the 1 %, four do, at half the work),
skipping a set where testing it would leave too little work for a larger one (which proves
whatever the smaller would).

In a DAG the hop from a stage [i, j) carries every tensor of [i, j) the next stage [j, k)
reads, not only what layer j reads: cut inside a residual block, it sends the block's input on
to the add as well. The suffix states carry a class (`hop_classes`): how many of the first
skip readers of cut j their first stage holds; behind a suffix of class q, the hop is priced
with those readers' tensors too (ResNet-50 on 16 devices at 1 GB/s, tight, cross-stage DP:
4676 -> 5474 ms; GNMT: 244 -> 285 ms), at 1.4-1.8x the work of a DP without classes.

The same cut delays the receiving stage itself: its first forward waits for every tensor it
reads, each sent by the stage holding its producer p once p's forward is done, and after its
last backward their gradients go back before p's backward and the layers before it. With the
cross-stage conditions, H and Tl of a stage [i, j) are at least those of each layer p before
it, exactly per (i, j) (`skip_arrivals`: HF(p + 1) + the transfer of what [i, j) reads from
p, and that transfer + the backward of the layers up to p). A residual block's input goes to
its add: ResNet-101 on 16 devices at 1 GB/s, a stage cut inside a block waits 161 ms for
it where `into_ms` gave 124; with the hop classes, that proves data parallelism alone
(745.2 ms) within 1 %, where a 2-stage plan met the conditions at 736 before.

A stage may run in several ways (`Variant`): at any TP degree the search may use (the shard's
measured time plus its TP all-reduces, the shard's bytes) and, where memory binds, recomputed
(the forward once more in B; memory = the tensors its layers read first plus one layer's
recomputed activations). Under zb-h1 the round trip runs through B only (the input gradient,
a stage's share `W / bwd` of its backward being W), the stage's W's follow, and after its last
B only the first stage's final W is sure to remain; every condition above holds with B in
place of the backward and its W's added to the stage's work.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from planner.cost import (
    OPTIMIZER_EXTRA_COPIES,
    LayerTable,
    microbatch_scale,
    transfer_ms,
)
from planner.formats import GB, Cluster


def replica_choices(num_microbatches: int, max_replicas: int) -> list[int]:
    """Per distinct n = ceil(m / r), the smallest r giving it: the bound prices a stage's time
    with it (as many microbatches, the most in flight, the cheapest all-reduce), and its memory
    and the suffix behind it with every r of that n (`_suffix_dp`). (Pricing the whole stage
    as the smallest r was not a relaxation: r = 10 where n = 2 leaves the stages before it
    more microbatches in flight than r = 8 does, ceil(replicas after / r).)"""
    out: list[int] = []
    seen: set[int] = set()
    for r in range(1, min(max_replicas, num_microbatches) + 1):
        n = -(-num_microbatches // r)
        if n not in seen:
            seen.add(n)
            out.append(r)
    return out


HOP_CLASSES = 3  # at most: the next stage holds none, the first or the first two skip readers
HOP_CLASS_LAYERS = 600  # up to this many layers (above, the DP is too large to run anyway)


def hop_classes(table: LayerTable, most: int = HOP_CLASSES
                ) -> tuple[int, np.ndarray | None, np.ndarray | None]:
    """The hop from a stage [i, j) to the next stage [j, k) carries every tensor produced in
    [i, j) that [j, k) reads, not only what layer j reads (`hop_bytes`): a residual block cut
    inside sends its input on too, to the add (ResNet-50: 513.8 MB where layer j reads 102.8).
    What the next stage reads depends on k, which the DP's suffix state does not know, so the
    suffix states get classes: the skip readers of cut j are the layers c > j that are the
    first reader from j on of a tensor (of some bytes) produced before j; a stage [j, k) is in
    class q = how many of the first Q - 1 of them it holds (c < k), and behind class q the hop
    carries the tensors produced in [i, j) read by layer j or first by one of those q readers.
    Every class q stage reads at least that, so it stays a bound. Returns Q (1 for a chain,
    where every hop is exact already), klass (L+1, L+1) and the bytes of classes 1..Q-1,
    (Q-1, L+1, L+1)."""
    L = table.num_layers
    if L > HOP_CLASS_LAYERS or most < 2:
        return 1, None, None
    skip = skip_readers(table, most)
    Q = 1 + max(len(x) for x in skip)
    if Q == 1:
        return 1, None, None
    klass = np.zeros((L + 1, L + 1), dtype=int)
    k = np.arange(L + 1)
    for j in range(1, L):
        if skip[j]:
            klass[j] = np.searchsorted(np.array(skip[j]), k, side="left")
    more = np.zeros((Q - 1, L + 1, L + 1))
    for t in table.tensors:
        p = t.producer
        if p < 0 or t.nbytes <= 0:
            continue
        cs = np.array(t.consumers)
        for j in range(p + 1, int(cs.max(initial=p)) + 1):
            first = int(cs[np.searchsorted(cs, j)])  # its first reader from cut j on
            if first == j or first not in skip[j]:
                continue  # read by layer j (in `hop_bytes` already), or past the classes
            more[skip[j].index(first):, : p + 1, j] += t.nbytes
    return Q, klass, more


def skip_readers(table: LayerTable, most: int = HOP_CLASSES) -> list[list[int]]:
    """Per cut j, its first `most - 1` skip readers (`hop_classes`): the layers c > j that are
    the first reader from j on of a tensor (of some bytes) produced before j, ascending."""
    L = table.num_layers
    firsts: list[set[int]] = [set() for _ in range(L + 1)]  # per cut j, the skip readers
    for t in table.tensors:
        if t.producer < 0 or t.nbytes <= 0:
            continue
        prev = t.producer
        for c in sorted(t.consumers):  # from cut j in (prev, c), c reads it first
            for j in range(prev + 1, c):
                firsts[j].add(c)
            prev = max(prev, c)
    return [sorted(x)[:most - 1] for x in firsts]


def skip_arrivals(table: LayerTable, scale: float, HF: np.ndarray, tail_b: np.ndarray,
                  transfer) -> tuple[np.ndarray, np.ndarray] | None:
    """What a stage [i, j) receives from each layer p before it: every tensor of p that one of
    its layers reads. The stage that holds p sends them to it in one message, after its
    forward of p (no earlier than HF[p + 1]); the simulator starts the stage's forward only
    when every message has arrived, and the gradients go back the same way before the
    backward of p and the layers before it (`tail_b[p]`) can run. Returns (arrive[i, j],
    leave[i, j]): the latest over p of HF[p + 1] + transfer, and of transfer + tail_b[p]
    (fastest link), 0 where nothing is read; None where no tensor skips a layer and the
    stages read nothing `into_ms` leaves out. A residual block cut inside: its input was
    produced a few layers back and goes to the add in the stage, where `into_ms` counts only
    what layer i reads from layer i - 1 (ResNet-101 on 16 devices at 1 GB/s: 12.8 ms against
    51.4 for the block's input)."""
    L = table.num_layers
    by_p: dict[int, list[tuple[list[int], float]]] = {}
    for t in table.tensors:
        cs = sorted(x for x in t.consumers if x > t.producer)
        if t.producer >= 0 and t.nbytes > 0 and cs:
            by_p.setdefault(t.producer, []).append((cs, t.nbytes * scale))
    if all(len(ts) == 1 and ts[0][0] == [p + 1] for p, ts in by_p.items()):
        return None  # a chain: every hop is `into_ms` already
    arrive, leave = np.zeros((L + 1, L + 1)), np.zeros((L + 1, L + 1))
    for p, ts in by_p.items():
        for i in range(p + 1, max(cs[-1] for cs, _ in ts) + 1):
            # each tensor read from cut i on joins the message of every stage [i, j > its first reader)
            firsts = sorted((cs[int(np.searchsorted(cs, i))], nb) for cs, nb in ts if cs[-1] >= i)
            total = 0.0
            for f, nb in firsts:
                total += nb
                x = float(transfer(np.array([total]))[0])
                arrive[i, f + 1:] = np.maximum(arrive[i, f + 1:], HF[p + 1] + x)
                leave[i, f + 1:] = np.maximum(leave[i, f + 1:], x + tail_b[p])
    return arrive, leave


def hop_bytes(table: LayerTable) -> np.ndarray:
    """`h[i, j]` = bytes (profiled batch) of the tensors produced by layers i..j-1 and used by
    layer j: whatever stage holds layer j receives at least these from a stage [i, j)."""
    L = table.num_layers
    h = np.zeros((L + 1, L + 1))
    for t in table.tensors:
        if t.producer < 0:
            continue
        for c in t.consumers:
            if c > t.producer:
                h[: t.producer + 1, c] += t.nbytes
    return h


def cut_hop_bytes(table: LayerTable) -> np.ndarray:
    """`h[i, j]` = bytes (profiled batch) of the tensors produced by layers i..j-1 and read by
    layer j or later: what a stage [i, j) sends across the cut at j. Where the next stage holds
    every reader (a residual block cut inside), that stage receives all of it, where
    `hop_bytes` counts only what layer j reads (ResNet-50 cut inside a block: 102.8 MB against
    the 513.8 MB the simulator sends). More than the next stage receives where a tensor skips
    it, so it prices seeds, never the bound."""
    L = table.num_layers
    h = np.zeros((L + 1, L + 1))
    for t in table.tensors:
        if t.producer < 0:
            continue
        last = max(t.consumers, default=t.producer)
        if last > t.producer:
            h[: t.producer + 1, t.producer + 1: last + 1] += t.nbytes
    return h


@dataclass(frozen=True)
class Variant:
    """One way to run a stage (internal): its tensor-parallel degree, whether it recomputes,
    and prefix arrays of its per-microbatch costs at the microbatch size and fastest speed."""

    tp: int
    recompute: bool
    Fp: np.ndarray  # forward ms (TP all-reduces included)
    Bp: np.ndarray  # whole backward ms (TP all-reduces included; recomputation not)
    Pp: np.ndarray  # parameter bytes (of one TP shard)
    Ap: np.ndarray  # activation bytes kept per microbatch in flight (scaled); recompute: see `kept`
    Zp: np.ndarray | None = None  # of Pp, the parameters without gradients (frozen); None: none
    # one optimizer step (ms, fastest speed), after the stage's all-reduce; None: 0 (not
    # measured, or a TP variant: its shard's share is not priced here, which only lowers the bound)
    Op: np.ndarray | None = None

    def optimizer_ms(self, lo, hi):
        """The optimizer step of stages [lo, hi) (one side an index, the other an array)."""
        return 0.0 if self.Op is None else self.Op[hi] - self.Op[lo]

    def static_prefix(self, coef: float) -> np.ndarray:
        """Parameters, gradients and optimizer state, prefix: `coef` copies of every parameter
        but one of a frozen one (`cost.static_memory_bytes`)."""
        return coef * self.Pp if self.Zp is None else coef * self.Pp - (coef - 1) * self.Zp

    def trained_prefix(self) -> np.ndarray:
        """The parameters whose gradients replicas all-reduce, prefix."""
        return self.Pp if self.Zp is None else self.Pp - self.Zp


@dataclass(frozen=True)
class Conditions:
    """The per-stage quantities of the bound for one microbatch size (internal)."""

    L: int
    D: int
    m: int
    schedule: str
    rs: np.ndarray  # replica choices (R,)
    n: np.ndarray  # ceil(m / r) (R,)
    variants: tuple[Variant, ...]
    Cp: np.ndarray  # unsharded forward + backward prefix (a 0-ms stage has no devices)
    Wshare_num: np.ndarray  # unsharded W prefix and B prefix: a stage's W is its share of B
    Wshare_den: np.ndarray
    HF: np.ndarray  # per layer the smallest forward of any variant, prefix (L+1,)
    HB: np.ndarray  # per layer the smallest critical backward of any variant, prefix
    kept_lo: np.ndarray  # recomputation: bytes of tensors first read by layer i, prefix (scaled)
    layer_act: np.ndarray  # what a recomputed layer holds during its backward (scaled) (L,)
    first_bwd_lo: float  # zb-h1: the smallest whole backward of layer 0 (the first stage's W)
    hop_ms: np.ndarray  # (2, L+1, L+1): [fast link?, i, j] transfer of hop_bytes at that link
    into_ms: np.ndarray  # (2, L+1): smallest transfer into layer i (from layer i-1 alone)
    skip_ms: np.ndarray  # (L+1, L+1): a round trip past the next stage, `skip_round_trips`
    per_node: int
    static_coef: float
    memory_bytes: float
    intra_gbps: float
    inter_gbps: float
    latency_us: float
    # memory priced with the most microbatches a stage can hold (1F1B's warm-up is at most
    # ceil(devices of the suffix / replicas)): not a bound, but plans that fit (a seed)
    pessimistic: bool = False
    # hops priced by node groups (`_suffix_dp`): tighter on clusters whose links inside a node
    # are faster, and 2-5x the work of a DP that prices a hop fast whenever its stage and one
    # more device fit in a node
    grouped: bool = False
    # the cross-stage conditions (`tighten`): each stage's last backward after its
    # successor's, and a DAG's tensors sent past the next stage (`skip_ms`). Off in the
    # bisection whose plans seed the search (its plans are those the search was tuned on:
    # any change of seed moves where the local search ends, both ways), on when the bound is
    # tightened after the search
    cross_stage: bool = False
    # with cross_stage, the hops of the stages before each stage (`_prefix_hops`): about one
    # DP without node groups more per step, so `tighten` drops them where steps are scarce
    prefix_hops: bool = True
    # with cross_stage, the first and the last microbatch through the stages after each
    # (module docstring): MICROBATCH_PATHS_WORK x the work, so `tighten` takes them only where
    # it affords the steps to prove the 1 % with them
    microbatch_paths: bool = False
    # with cross_stage, each microbatch's last backward on its own (`_suffix_dp`): a replica's
    # backward of microbatch q waits for the next stage's, which waited for that stage's
    # replica to run every microbatch before q on it; about m times the cross-stage work
    per_microbatch: bool = False
    # with per_microbatch, the microbatches whose last backward the DP tracks (empty: all of
    # them). Each microbatch's condition stands on its own, so any subset is a relaxation too,
    # at a fraction of the work (`prove`)
    tracked: tuple[int, ...] = ()
    # hop classes (`hop_classes`): the next stage's class per cut, klass[i, k] for a stage
    # [i, k), and per class above 0 the hop priced with what that class's stage surely reads,
    # (Q - 1, 2, L+1, L+1) like `hop_ms`; one class (None, None) for a chain
    klass: np.ndarray | None = None
    hop_more_ms: np.ndarray | None = None
    # with cross_stage, per stage [i, j): the earliest the tensors it reads from each layer
    # before it arrive, and the least time from its last backward to the end of the iteration
    # through their gradients (`skip_arrivals`; None for a chain)
    skip_in: np.ndarray | None = None
    skip_out: np.ndarray | None = None
    # stages that compute nothing (0 ms) allowed: False for the DPs whose plans seed the search
    # (which leaves them out, `space.Evaluator.allowed`), True for the bound every plan must
    # respect where a 0-ms layer exists (`search._idle_checked`): alone on a device, such a
    # layer can take memory off the others, so plans with one can be faster
    idle_stages: bool = False

    @property
    def hop_classes(self) -> int:
        return 1 if self.hop_more_ms is None else 1 + len(self.hop_more_ms)

    @property
    def tmax(self) -> int:
        return max(v.tp for v in self.variants)


def _variants(table: LayerTable, cluster: Cluster, scale: float, vmax: float,
              degrees: tuple[int, ...], recompute: bool) -> list[Variant]:
    frozen = None if table.frozen_prefix_bytes is None else np.array(table.frozen_prefix_bytes, dtype=float)
    out = [Variant(1, False, np.array(table.fwd_prefix_ms) * scale / vmax,
                   np.array(table.bwd_prefix_ms) * scale / vmax,
                   np.array(table.param_prefix_bytes, dtype=float),
                   np.array(table.activation_prefix_bytes, dtype=float) * scale, frozen)]
    if recompute:
        out.append(Variant(1, True, out[0].Fp, out[0].Bp, out[0].Pp, out[0].Ap, frozen))
    gbps = cluster.intra_node_gb_per_s
    lat = least_latency_us(cluster)
    for t in degrees:
        if t <= 1:
            continue
        tt = table.at_degree(t)
        k = 2 * (t - 1) / t / (gbps * 1e9) * 1e3 * scale
        cf = (np.array(tt.ar_fwd_prefix_bytes, dtype=float) * k
              + np.array(tt.ar_fwd_prefix_count, dtype=float) * 2 * (t - 1) * lat / 1e3)
        cb = (np.array(tt.ar_bwd_prefix_bytes, dtype=float) * k
              + np.array(tt.ar_bwd_prefix_count, dtype=float) * 2 * (t - 1) * lat / 1e3)
        eff = cluster.allreduce_efficiency
        # each TP rank holds the layers' buffers whole (`cost._stage_cost`)
        buffers = None if table.buffer_prefix_bytes is None else np.array(table.buffer_prefix_bytes, dtype=float)
        out.append(Variant(t, False, np.array(tt.fwd_prefix_ms) * scale / vmax + cf / eff,
                           np.array(tt.bwd_prefix_ms) * scale / vmax + cb / eff,
                           np.array(tt.param_prefix_bytes, dtype=float) + (0.0 if buffers is None else buffers),
                           np.array(tt.activation_prefix_bytes, dtype=float) * scale, buffers))
    return out


def least_latency_us(cluster: Cluster) -> float:
    """The smallest per-message latency of any link class (a calibrated cluster may give each
    class its own, `cost.link_latency_us`): the bound prices every message with it."""
    given = [v for v in (cluster.intra_node_latency_us, cluster.inter_node_latency_us) if v is not None]
    return min([cluster.latency_us, *given])


def _allreduce_ms(params: np.ndarray, r: int, gbps: float, latency_us: float) -> np.ndarray:
    """`cost.allreduce_ms` of every entry of `params` (the same arithmetic, vectorised)."""
    if r <= 1:
        return np.zeros_like(params)
    return np.where(params > 0, 2 * (r - 1) / r * params / (gbps * GB) * 1e3
                    + 2 * (r - 1) * latency_us / 1e3, 0.0)


def _min_prefix(prefixes: list[np.ndarray]) -> np.ndarray:
    per_layer = np.min(np.stack([np.diff(p) for p in prefixes]), axis=0)
    return np.concatenate([[0.0], np.cumsum(per_layer)])


def conditions(table: LayerTable, cluster: Cluster, optimizer: str, schedule: str,
               global_batch: int, microbatch_size: int,
               hops: np.ndarray | None = None, degrees: tuple[int, ...] = (1,),
               recompute: bool = False, classes: int = HOP_CLASSES) -> Conditions:
    """`degrees`: the TP degrees a stage may have; `recompute`: whether it may recompute;
    `classes`: the most hop classes (`hop_classes`; 1 where `hops` are not `hop_bytes`)."""
    L, D = table.num_layers, cluster.num_devices
    m = global_batch // microbatch_size
    scale = microbatch_scale(table.batch_size, microbatch_size)
    devices = cluster.devices()
    vmax = max(d.speed for d in devices)
    per_node = max(s.devices for s in cluster.node_specs())
    rs = replica_choices(m, D)
    n = [-(-m // r) for r in rs]
    h = (hop_bytes(table) if hops is None else hops) * scale
    fast = cluster.intra_node_gb_per_s if per_node > 1 else cluster.inter_node_gb_per_s
    fast = max(fast, cluster.inter_node_gb_per_s)
    lat = least_latency_us(cluster)

    def ms(nbytes: np.ndarray, gbps: float) -> np.ndarray:
        return np.where(nbytes > 0, nbytes / (gbps * 1e9) * 1e3 + lat / 1e3, 0.0)

    hop_ms = np.stack([ms(h, cluster.inter_node_gb_per_s), ms(h, fast)])
    Q, klass, more = hop_classes(table, classes)
    if Q > 1 and hops is not None and not np.array_equal(hops, hop_bytes(table)):
        # classes price what the next stage reads of the tensors `hop_bytes` leaves out: on
        # top of any other hops (the seeds' `cut_hop_bytes`) they would count tensors twice
        klass = more = None
    more_ms = None if more is None else np.stack(
        [np.stack([ms(h + x * scale, cluster.inter_node_gb_per_s), ms(h + x * scale, fast)]) for x in more])
    into = np.zeros((2, L + 1))
    for i in range(1, L):
        into[:, i] = hop_ms[:, i - 1, i]
    variants = _variants(table, cluster, scale, vmax, degrees, recompute)
    opt = table.optimizer_prefix(optimizer)
    if opt is not None:
        variants = [replace(v, Op=np.array(opt, dtype=float) / vmax) if v.tp == 1 else v for v in variants]
    Wp = np.array(table.bwd_weight_prefix_ms if table.bwd_weight_prefix_ms is not None
                  else [0.5 * x for x in table.bwd_prefix_ms], dtype=float)
    Bu = np.array(table.bwd_prefix_ms, dtype=float)
    HF = _min_prefix([v.Fp for v in variants])
    # the backward after a stage's last B: zb-h1 defers W's, so only the first stage's W (a
    # whole backward of layer 0, `first_bwd_lo`) is sure to follow it; else every backward
    HB = np.zeros(L + 1) if schedule == "zb-h1" else _min_prefix([v.Bp for v in variants])
    kept_lo, layer_act = recompute_prefixes(table, scale)
    first_bwd_lo = min(float(v.Bp[1] - v.Bp[0]) for v in variants) if L else 0.0
    tail_b = np.full(L, first_bwd_lo) if schedule == "zb-h1" else HB[1:]  # [p]: after layer p's gradient
    skips = skip_arrivals(table, scale, HF, tail_b, lambda b: ms(b, fast))
    skip_in, skip_out = skips if skips is not None else (None, None)
    return Conditions(
        L=L, D=D, m=m, schedule=schedule, rs=np.array(rs, dtype=float), n=np.array(n, dtype=float),
        variants=tuple(variants),
        Cp=np.array(table.fwd_prefix_ms) + Bu, Wshare_num=Wp, Wshare_den=Bu, HF=HF, HB=HB,
        kept_lo=kept_lo, layer_act=layer_act,
        first_bwd_lo=first_bwd_lo,
        hop_ms=hop_ms, into_ms=into, per_node=per_node,
        skip_ms=skip_round_trips(table, scale, HF, HB, lambda b: ms(b, fast)),
        static_coef=2 + OPTIMIZER_EXTRA_COPIES[optimizer],
        memory_bytes=max(d.memory_bytes for d in devices),
        intra_gbps=fast, inter_gbps=cluster.inter_node_gb_per_s, latency_us=lat, grouped=True,
        klass=klass, hop_more_ms=more_ms, skip_in=skip_in, skip_out=skip_out,
    )


def recompute_prefixes(table: LayerTable, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """What recomputed stages hold, at microbatch `scale`: per microbatch in flight, the
    tensors its layers read first (prefix over layers, each tensor counted at its first
    reader: a stage's inputs at least), (L+1,); and while a layer's backward runs, what that
    recomputed layer holds (`cost.LayerTable.recompute_bytes`): its activations less its
    inputs (kept already) and, on the last layer, the loss's, (L,)."""
    L = table.num_layers
    kept = np.zeros(L + 1)
    for t in table.tensors:
        kept[min(t.consumers) + 1] += t.nbytes * scale
    own = np.array(table.saved_input_bytes or [0] * L, dtype=float)
    own[-1:] += table.loss_activation_bytes
    layer_act = np.maximum(np.diff(np.array(table.activation_prefix_bytes, dtype=float)) - own, 0.0) * scale
    return np.cumsum(kept), layer_act


def skip_round_trips(table: LayerTable, scale: float, HF: np.ndarray, HB: np.ndarray,
                     transfer) -> np.ndarray:
    """`s[i, j]`: the least time from the end of a stage [i, j)'s forward of a microbatch to
    the start of its backward, from the tensors it sends past layer j: a tensor produced in
    [i, j) and read by layer l goes to the stage holding l, whose backward ends after that
    microbatch's forward and backward of every layer from l on, and its gradient comes back:
    2 x its transfer (fastest link) + the forward and critical backward of layers l.. (`HF`,
    `HB`, fastest variant). -inf where nothing is read past j. In a DAG (GNMT, U-Net) these
    skips can take longer than the next stage's own round trip."""
    L = table.num_layers
    tail = (HF[L] - HF) + (HB[L] - HB)  # (L+1,)
    best = np.full((L + 1, L + 1), -np.inf)  # [producer p, j]: over tensors of p read at l >= j
    for t in table.tensors:
        p = t.producer
        if p < 0 or t.nbytes <= 0:
            continue
        back = 2 * float(transfer(np.array([t.nbytes * scale]))[0])
        for c in t.consumers:
            if c > p + 1:
                v = back + tail[c]
                best[p, p + 1:c + 1] = np.maximum(best[p, p + 1:c + 1], v)
    # s[i, j] = max over producers p in [i, j) of best[p, j]
    s = np.full((L + 1, L + 1), -np.inf)
    for j in range(1, L + 1):
        col = best[:j, j]
        s[:j, j] = np.maximum.accumulate(col[::-1])[::-1]
    return s


@dataclass(frozen=True)
class BoundPlan:
    """A split and replica vector meeting every condition at `bound_ms`."""

    bound_ms: float
    bounds: tuple[int, ...]  # stage boundaries [0, ..., L]
    replicas: tuple[int, ...]
    tp: tuple[int, ...] = ()
    recompute: tuple[bool, ...] = ()
    seed: bool = True  # whether the search may start from it


def _group_size(c: Conditions) -> int:
    """Devices a run of fast hops may span: a hop is on a fast link only if both stages' devices
    share one node, so consecutive fast hops keep their stages on one node (at most `per_node`
    devices). 1 where links inside a node are no faster than between nodes (or nodes have one
    device) or `c.grouped` is off: a hop is then fast whenever its stage and one more device
    fit in a node."""
    return c.per_node if c.grouped and c.per_node > 1 and c.intra_gbps > c.inter_gbps else 1


# the layers a stage from layer i may end at where memory binds (`memory_band`), per the
# memory arrays they come from: a `replace` of the conditions keeps its arrays, so its band is
# looked up, not computed again (the entry holds the arrays: their ids stay theirs)
_BAND_MEMO: dict[tuple, tuple[tuple, np.ndarray]] = {}
_BAND_MEMO_SIZE = 16
_BAND_LOCK = threading.Lock()
BAND_SLACK = 1e-9  # relative: the band admits a stage the DP's own memory test may round in


def memory_band(c: Conditions) -> np.ndarray:
    """band[i] (L,): the last layer j (exclusive) up to which some variant's stage [i, j)
    fits memory with one microbatch in flight (parameters and optimizer state, the recomputed
    layer's activations, one microbatch's kept tensors); i where none does. Every stage the
    DP's memory test admits (at least one microbatch in flight in every schedule) lies within
    it, and a stage's memory grows with its layers, so `_suffix_dp` and `_prefix_hops` look at
    stages [i, j <= band[i]) only, with results the same to the last bit: where memory binds
    (the tight rows of the plan-quality suite: 20-70 % of the (i, j) pairs) that much less
    work. Non-decreasing in i."""
    key = (c.L, float(c.memory_bytes), float(c.static_coef), id(c.kept_lo), id(c.layer_act),
           tuple((id(v.Pp), id(v.Ap), id(v.Zp), v.recompute) for v in c.variants))
    hit = _BAND_MEMO.get(key)
    if hit is not None:
        return hit[1]
    L = c.L
    lim = c.memory_bytes * (1 + BAND_SLACK)
    band = np.arange(L)
    if np.any(c.layer_act < 0):
        return np.full(L, L)  # not monotone: no band (every j looked at)
    for v in c.variants:
        base = v.static_prefix(c.static_coef) + (c.kept_lo if v.recompute else v.Ap)  # (L+1,)
        if np.any(np.diff(base) < 0):
            return np.full(L, L)
        if not v.recompute:
            band = np.maximum(band, np.searchsorted(base, base[:L] + lim, side="right") - 1)
            continue
        # recomputed: one layer's activations more, the largest of the stage's layers
        top = np.searchsorted(base, base[:L] + lim - c.layer_act, side="right") - 1  # >= j
        for i in np.nonzero(top > band)[0]:
            i = int(i)
            need = base[i + 1:top[i] + 1] - base[i] + np.maximum.accumulate(c.layer_act[i:top[i]])
            band[i] = max(band[i], i + int(np.count_nonzero(need <= lim)))
    band = np.maximum.accumulate(np.minimum(band, L))
    with _BAND_LOCK:  # the service plans in threads
        while len(_BAND_MEMO) >= _BAND_MEMO_SIZE:
            del _BAND_MEMO[next(iter(_BAND_MEMO))]
        _BAND_MEMO[key] = ((c.kept_lo, c.layer_act, tuple((v.Pp, v.Ap, v.Zp) for v in c.variants)), band)
    return band


def band_cells(c: Conditions) -> int:
    """The (i, j) pairs of stages within the memory band (`memory_band`): L (L + 1) / 2
    where memory does not bind."""
    return int((memory_band(c) - np.arange(c.L)).sum())


def _stage_costs(c: Conditions, v: Variant, lo, hi, share: np.ndarray, zb: bool):
    """Per microbatch, of stages [lo, hi) run as `v` (one side an index, the other an array):
    forward, critical backward (the whole backward, or B under zb-h1, recomputation's
    forward included), W, their sum, (static bytes: parameters, gradients and optimizer state;
    the parameter bytes replicas all-reduce) and activation bytes kept in flight."""
    fwd = v.Fp[hi] - v.Fp[lo]
    full = v.Bp[hi] - v.Bp[lo]
    if zb:
        wgt = full + fwd if v.recompute else full * share
        crit = full - full * share + (fwd if v.recompute else 0.0)
    else:
        wgt = np.zeros_like(full)
        crit = full + (fwd if v.recompute else 0.0)
    act = (c.kept_lo[hi] - c.kept_lo[lo]) if v.recompute else (v.Ap[hi] - v.Ap[lo])
    if v.Zp is None:
        params = v.Pp[hi] - v.Pp[lo]
        return fwd, crit, wgt, fwd + crit + wgt, (params * c.static_coef, params), act
    static, trained = v.static_prefix(c.static_coef), v.trained_prefix()
    return fwd, crit, wgt, fwd + crit + wgt, (static[hi] - static[lo], trained[hi] - trained[lo]), act


def _busy(n, w, f2, c2, rt) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A stage's busiest replica with n microbatches, w in flight, forward f2 and critical
    backward c2 each, and round trip rt (the module docstring): when its first backward can
    end, when its last can, and the time to its last critical backward (its work, or either)."""
    rounds = np.floor((n - 1) / w)  # groups of w before the last forward
    last = np.maximum((n - 1) * f2 + (n - w) * c2 + rt,
                      np.where(rounds > 0, rounds * (rt - w * f2), 0.0) + (n - 1) * f2 + rt)
    first = rt + (n - 1) * c2 + (n - w) * f2
    return first, last, np.maximum(np.maximum(n * (f2 + c2), first), last)


def _most_prefix_hops(hop, base_rt, f2, c2, n, w, comp, wgt, room_busy, room_full, mem_ok) -> np.ndarray:
    """For `_prefix_hops`: the largest hop sum x before a prefix stage at which it meets its
    conditions with `hop` (R, A) out of it, (R, A, D+1) (-inf where memory does not fit):
    HF + x + max(busy + Tl0 + x, full + AR) <= T, with `room_busy` = T - HF - Tl0 and
    `room_full` = T - HF - AR."""
    first, _, crit_busy = _busy(n, w, f2, c2, base_rt + 2 * hop[:, :, None])
    full_busy = np.maximum(n * comp, first + n * wgt)
    return np.where(mem_ok, np.minimum((room_busy - crit_busy) / 2, room_full - full_busy), -np.inf)


def replica_counts(c: Conditions, v: Variant) -> np.ndarray:
    """Every replica count a stage run as `v` may have (1 .. min(D / tp, m)), each priced by
    its own microbatches in flight and devices; the replica choices alone (the smallest count
    of each n = ceil(m / r)) under the pessimistic seed conditions."""
    if c.pessimistic:
        return c.rs[c.rs * v.tp <= c.D]
    return np.arange(1, min(c.D // v.tp, c.m) + 1, dtype=float)


def variant_choices(c: Conditions, v: Variant) -> tuple[np.ndarray, np.ndarray]:
    """The replica choices a stage run as `v` may take (`replica_choices`) and their n. With
    the cross-stage conditions (`tighten`, `prove`), a choice whose counts reach past a node
    is split there: its smallest count is priced with an all-reduce inside a node, but the
    counts of more devices than a node has all-reduce across nodes (GNMT on 4 x 4 devices: a
    stage of 5 replicas, priced as one of 4, all-reduced in 44 ms for 440; its plan met every
    condition at 193 ms and simulates to 629). Each part is priced with its own smallest
    count, so it stays a relaxation. (Not in the first bisection, whose plans seed the search;
    not where both link classes are alike.) At most one more choice per variant: `dp_work` does
    not count it (within its 25 %). Counted, `tighten` afforded fewer steps where the budget is
    short, and lost more than the split gained there (`benchmarks/README.md`, plan_quality.py,
    "A stage of more replicas than a node holds")."""
    keep = c.rs * v.tp <= c.D
    rs, n = c.rs[keep], c.n[keep]
    if not c.cross_stage or c.pessimistic or c.per_node >= c.D or c.intra_gbps == c.inter_gbps:
        return rs, n
    counts = np.arange(1, min(c.D // v.tp, c.m) + 1, dtype=float)
    cn = np.ceil(c.m / counts)
    inside = counts * v.tp <= c.per_node
    first = np.r_[True, (cn[1:] != cn[:-1]) | (inside[1:] != inside[:-1])]
    return counts[first], cn[first]


def _prefix_hops(c: Conditions, T: float) -> np.ndarray:
    """X[i, e]: the least sum of hop transfers of a prefix of stages covering layers [0, i),
    the stages from layer i on having exactly e devices, each prefix stage meeting at T the
    conditions that need nothing of the stages after it but their devices (inf: none). The
    suffix DP's H(i) and Tl(i) count only the hop into layer i; a first microbatch reaches
    layer i only through every hop of the prefix, and its gradient comes back through them, so
    both are at least the prefix's compute plus X[i, devices of the suffix]. Where memory or
    time forces the layers before i into several stages on slow links, that is several hops
    more.

    A prefix stage [a, b) with r replicas on dd devices, n = ceil(m / r) microbatches on its
    busiest replica, e devices after it, its hop sum before it Xa = X[a, e + dd] (priced with
    `Xa` in place of the hops before a): memory with the microbatches in flight of 1F1B's
    warm-up (as `_suffix_dp`: at least min(n, ceil(1 + e / (largest TP degree x r)))) or n
    under GPipe; the work condition; and the round trip, at least its own compute, its hop
    there and back and the fastest compute of every layer after it, with at most min(n,
    ceil((dd + e) / r)) microbatches in flight. Hops are priced by node groups as in
    `_suffix_dp`: with groups, X[i, e, g] (g = 0: the hop into layer i is slow; g > 0: it is
    fast and the group the next stage joins holds g devices already), and a run of fast hops
    keeps its stages within a node's devices; without them, a hop out of a stage is fast
    where the stage and one more device fit a node. Each is a relaxation of the suffix DP's
    condition for the same stage, so every plan meeting the suffix DP's conditions at T has a
    prefix counted here, and a smaller Xa only makes the conditions easier: keeping the least
    X per (b, e, g) is exact for them. (Indexed by the devices before i instead, a prefix of
    one-replica stages on fast links met its memory with 2 microbatches in flight where its
    warm-up holds one per stage after it: AlexNet on 4 x 4 devices, tight memory, priced a
    198 MB hop at 10 GB/s where no plan can send it inside a node.)"""
    L, D = c.L, c.D
    P = _group_size(c)
    G = P + 1 if P > 1 else 1  # group states (`_suffix_dp`'s node groups), one without them
    X = np.full((L + 1, D + 1, G), np.inf)
    X[0, :, 0] = 0.0
    zb = c.schedule == "zb-h1"
    evec = np.arange(D + 1)
    tail = (c.HF[L] - c.HF) + (c.HB[L] - c.HB)  # fastest compute of layers i.. on the round trip
    tmax = c.tmax
    per_variant = []
    for v in c.variants:
        # every replica count, as `_suffix_dp` prices memory and devices (a choice's smallest
        # count holds the most microbatches in flight: pricing a stage of 5 replicas as one of
        # 4, both 4 microbatches at m = 16, found it over memory and raised the bound above a
        # plan that fits: SqueezeNet on 16 x 1 devices, tight, "optimal" at 4016.0 ms against
        # 3901.8); the pessimistic seed conditions keep the choices
        rs = replica_counts(c, v)
        n = np.ceil(c.m / rs)
        dd = (rs * v.tp).astype(int)
        # without groups, the hop out of a stage is inside a node only if the stage and one
        # more device fit one
        link = (dd + 1 <= c.per_node).astype(int)  # (R,)
        ar_gbps = np.where(dd <= c.per_node, c.intra_gbps, c.inter_gbps)
        src = evec[None, :] + dd[:, None]  # (R, D+1): devices from the stage on
        valid = src <= D
        w = np.minimum(n[:, None], np.ceil(src / rs[:, None]))  # (R, D+1)
        if c.schedule == "gpipe":  # every forward before the first backward (as `_suffix_dp`)
            w = np.broadcast_to(n[:, None], w.shape)
            inflight = np.broadcast_to(n[:, None], w.shape)
        else:
            inflight = np.minimum(n[:, None], np.ceil(1 + evec[None, :] / tmax / rs[:, None] - 1e-9))
        per_variant.append((v, rs, dd, link, n[:, None, None], ar_gbps, valid, np.where(valid, src, 0),
                            np.maximum(w, 1.0)[:, None, :], np.maximum(inflight, 1.0)[:, None, :]))
    slack = 1e-12 * abs(T)  # the conditions as thresholds on the prefix's hops: rounding aside
    band = memory_band(c)
    for b in range(1, L):
        a = np.arange(int(np.searchsorted(band, b)), b)  # the stages [a, b) that may fit memory
        if not len(a):
            continue
        share = np.clip((c.Wshare_num[b] - c.Wshare_num[a])
                        / np.where(c.Wshare_den[b] > c.Wshare_den[a], c.Wshare_den[b] - c.Wshare_den[a], 1.0),
                        0.0, 1.0)
        share[a == 0] = 1.0  # the first stage sends no gradient: all of it is W
        Tl0 = np.where(a > 0, c.first_bwd_lo, 0.0) if zb else c.HB[a]
        peak = np.maximum.accumulate(c.layer_act[a[0]:b][::-1])[::-1]  # (A,): layers a..b-1
        for v, rs, dd, link, n, ar_gbps, valid, src, w, inflight in per_variant:
            if len(rs) == 0:
                continue
            fwd, crit, wgt, comp, (static, params), act = _stage_costs(c, v, a, b, share, zb)
            transient = peak if v.recompute else 0.0
            mem_ok = ((static + transient)[None, :, None]
                      + act[None, :, None] * inflight <= c.memory_bytes)  # (R, A, D+1)
            ar = np.stack([_allreduce_ms(params, int(r), float(bw), c.latency_us)
                           for r, bw in zip(rs, ar_gbps, strict=True)])  # (R, A)
            ar = ar + v.optimizer_ms(a, b)  # the stage's tail: all-reduce, then optimizer step
            f2, c2 = fwd[None, :, None], crit[None, :, None]

            room = (T + slack - c.HF[a])[None, :, None]
            terms = ((fwd + crit + tail[b])[None, :, None], f2, c2, n, w, comp[None, :, None],
                     wgt[None, :, None], room - Tl0[None, :, None], room - ar[:, :, None], mem_ok)
            Xall = np.where(valid[:, None, :, None], X[a][:, src].transpose(1, 0, 2, 3), np.inf)  # (R, A, D+1, G)
            if G == 1:
                hop = c.hop_ms[link[:, None], a[None, :], b]  # (R, A) (hop_ms[link] would copy all of it)
                Xa = Xall[..., 0]
                val = np.where(Xa <= _most_prefix_hops(hop, *terms), Xa + hop[:, :, None], np.inf)
                X[b, :, 0] = np.minimum(X[b, :, 0], val.min(axis=(0, 1)))
                continue
            # node groups: state g = 0, the hop into the stage is slow (it starts a group); g > 0,
            # the hop into it is fast and the group it joins holds g devices already
            hop_slow = np.broadcast_to(c.hop_ms[0][a, b][None, :], (len(rs), len(a)))
            hop_fast = np.broadcast_to(c.hop_ms[1][a, b][None, :], (len(rs), len(a)))
            most_slow, most_fast = _most_prefix_hops(hop_slow, *terms), _most_prefix_hops(hop_fast, *terms)
            for g in range(G):
                Xa = Xall[..., g]  # (R, A, D+1)
                fill = dd if g == 0 else dd + g  # the group's devices with this stage
                joins = (fill <= P) | (g == 0)  # a stage of more than a node is a group of its own
                if not joins.any():
                    continue
                ok = joins[:, None, None] & (Xa <= most_slow)
                val = np.where(ok, Xa + hop_slow[:, :, None], np.inf)
                X[b, :, 0] = np.minimum(X[b, :, 0], val.min(axis=(0, 1)))
                onward = joins & (fill + 1 <= P)  # room for the next stage in its group
                if not onward.any():
                    continue
                ok = onward[:, None, None] & (Xa <= most_fast)
                val = np.where(ok, Xa + hop_fast[:, :, None], np.inf).min(axis=1)  # (R, D+1)
                for k in np.nonzero(onward)[0]:
                    X[b, :, fill[k]] = np.minimum(X[b, :, fill[k]], val[k])
    return X if G > 1 else X[:, :, 0]


def _per_count(mask: np.ndarray, table: np.ndarray, dd: np.ndarray) -> np.ndarray:
    """The suffix (`table`, (J, D+1): g or z of each next layer) behind each replica count
    where `mask` (Ra, J, D+1) allows it, `dd` (Ra,) its devices (the suffix has d - dd):
    (Ra, J, D+1)."""
    J, width = table.shape
    padded = np.concatenate([np.full((J, width - 1), np.inf), table], axis=1)
    # shifted[s] = the table shifted right by width - 1 - s (inf shifted in)
    shifted = np.lib.stride_tricks.sliding_window_view(padded, width, axis=1).transpose(1, 0, 2)
    return np.where(mask, shifted[width - 1 - dd], np.inf)


def _class_min(per_r: np.ndarray, starts: np.ndarray, choices: int) -> np.ndarray:
    """Per replica choice, the least of `per_r` (Ra', ...) over its replica counts (those of
    its n, consecutive from `starts`; only the first Ra' of all exist here): (choices, ...)."""
    ends = [*starts[1:choices], len(per_r)]
    out = np.empty((choices, *per_r.shape[1:]))
    for q, (a, b) in enumerate(zip(starts[:choices], ends, strict=True)):  # (np.minimum.reduceat: 3x slower)
        b = min(b, len(per_r))
        out[q] = per_r[a] if b == a + 1 else per_r[a:b].min(axis=0)
    return out


def _behind(mask: np.ndarray, table: np.ndarray, dd: np.ndarray, starts: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """`_per_count`, and per replica choice the least over the replica counts of its n
    (consecutive from `starts`): (choices, J, D+1)."""
    per_r = _per_count(mask, table, dd)
    return per_r, _class_min(per_r, starts, len(starts))


def _behind_each(mask: np.ndarray, table: np.ndarray, dd: np.ndarray) -> np.ndarray:
    """`_per_count` of a table with one entry per microbatch, (J, D+1, M): (Ra, J, D+1, M)."""
    J, width, M = table.shape
    flat = table.transpose(2, 0, 1).reshape(M * J, width)
    per_r = _per_count(np.tile(mask, (1, M, 1)), flat, dd)
    return per_r.reshape(len(dd), M, J, width).transpose(0, 2, 3, 1)


def _fold_least(best: np.ndarray, ok: np.ndarray, value: np.ndarray, sel: np.ndarray) -> None:
    """For `_suffix_dp`: `best` (D+1,), in place, the least of itself and of `value` (rows,
    J, D+1) over the rows `sel` and every J where `ok`."""
    np.minimum(best, np.where(ok, value, np.inf)[sel].reshape(-1, len(best)).min(axis=0), out=best)


def _suffix_dp(c: Conditions, T: float, want_plan: bool = False, edges: StageEdges | None = None):
    """g[i, d, e]: the smallest round trip of a suffix of stages starting at layer i on exactly
    d devices that meets every condition at T (inf: none), its first stage in a node group of
    e devices (the stages joined to it by fast hops; e = `_group_size` for a group no stage may
    join; e = 0 only for the empty suffix). With `want_plan`, also the choices; with `edges`,
    every stage it allows (`StageEdges`).

    Every placement maps to a path of this DP (its maximal runs of intra-node hops are groups
    of at most a node's devices), so the DP's smallest T is a bound on every placement. Each
    transition is vectorised over (replica choice, last layer j, devices d); ties go to a slow
    hop, the fewest replicas, the shortest stage, then the earliest variant."""
    L, D = c.L, c.D
    P = _group_size(c)
    Q = c.hop_classes
    g = np.full((L + 1, D + 1, P + 1, Q), np.inf)
    g[L, 0, 0, 0] = 0.0
    # with c.cross_stage, z[i, d, e]: the earliest the suffix's first stage can end its last
    # backward (from the start of the iteration), minimised on its own beside g
    z = np.full((L + 1, D + 1, P + 1), np.inf)
    z[L, 0, 0] = -np.inf
    # with c.microbatch_paths, y[i, d, e]: the least time from the start of the last microbatch's
    # forward on the suffix's first stage to the end of the iteration (`Conditions.cross_stage`)
    y = np.full((L + 1, D + 1, P + 1), np.inf)
    y[L, 0, 0] = -np.inf
    # with c.microbatch_paths, u[i, d, e]: the least round trip of the first microbatch from the
    # suffix's first stage: each stage runs its warm-up forwards before its first backward
    u = np.full((L + 1, D + 1, P + 1), np.inf)
    u[L, 0, 0] = -np.inf
    cross = c.cross_stage
    paths = cross and c.microbatch_paths
    # with c.per_microbatch, zv[i, d, e, q]: the earliest the suffix's first stage can end the
    # backward of microbatch q, each minimised on its own
    vec = cross and c.per_microbatch
    qv = (np.array(c.tracked, dtype=float) if c.tracked else np.arange(c.m, dtype=float)) if vec else np.zeros(0)
    M = len(qv)
    zv = np.full((L + 1, D + 1, P + 1, M), np.inf)
    zv[L, 0, 0] = -np.inf
    choice = {} if want_plan else None
    dvec = np.arange(D + 1, dtype=float)
    zb = c.schedule == "zb-h1"
    tmax = c.tmax
    tmin = min(x.tp for x in c.variants)
    pre = _prefix_hops(c, T) if cross and c.prefix_hops else None
    per_variant = []  # per variant: the replica choices it can use and what depends on them only
    for v in c.variants:
        rs, n = variant_choices(c, v)
        dd = (rs * v.tp).astype(int)
        flat_link = (dd + 1 <= c.per_node).astype(int)  # without groups: fast if one more fits
        ar_gbps = np.where(dd <= c.per_node, c.intra_gbps, c.inter_gbps)
        valid = dvec[None, :] >= dd[:, None]  # (R, D+1): d includes this stage's devices
        if c.schedule == "gpipe":
            w = np.broadcast_to(n[:, None], valid.shape)
        else:
            w = np.where(valid, np.minimum(n[:, None], np.ceil(dvec[None, :] / rs[:, None])), 1.0)
        # every replica count of each choice's n (`replica_choices`; the choices alone for the
        # pessimistic seeds), consecutive: `starts` indexes each choice's first
        ra = replica_counts(c, v)
        na = np.ceil(c.m / ra)
        starts = np.searchsorted(ra, rs)  # each choice's smallest count (ra ascending)
        dda = (ra * v.tp).astype(int)
        valida = dvec[None, :] >= dda[:, None]
        idxa = np.where(valida, np.arange(D + 1)[None, :] - dda[:, None], 0)
        left = np.maximum(dvec[None, :] - dda[:, None], 0)
        if c.schedule == "gpipe":
            inflight = np.broadcast_to(na[:, None], valida.shape)
        elif c.pessimistic:  # the most replicas the suffix can have: its devices (smallest degree)
            inflight = np.minimum(na[:, None], np.ceil((ra[:, None] + left / tmin) / ra[:, None] - 1e-9))
        else:  # the stages after it have at least (devices left) / (largest degree) replicas
            inflight = np.minimum(na[:, None], np.ceil(1 + left / tmax / ra[:, None] - 1e-9))
        # per replica count r: microbatch q runs on replica q mod r (round robin), which runs
        # `mine` microbatches by q (q included) and `after` from q on (q included)
        mine = np.floor(qv[None, :] / ra[:, None]) + 1  # (Ra, M)
        after = np.floor((c.m - 1 - qv[None, :]) / ra[:, None]) + 1
        klass = np.searchsorted(starts, np.arange(len(ra)), side="right") - 1  # (Ra,): its choice
        # per choice the fewest warm-up forwards any of its replica counts runs (what it holds)
        w_least = _class_min(np.maximum(inflight, 1), starts, len(rs))
        per_variant.append((v, rs, n[:, None, None], dd, flat_link, ar_gbps, w[:, None, :],
                            (ra, starts, dda, valida, idxa, np.maximum(inflight, 1)), (mine, after, klass),
                            w_least[:, None, :]))
    band = memory_band(c)
    for i in range(L - 1, -1, -1):
        if band[i] <= i:
            continue  # no stage from layer i fits memory: g[i], z[i], ... stay inf
        j = np.arange(i + 1, band[i] + 1)  # the stages from i that may fit memory
        J = len(j)
        last_j = (j < L)[None, :, None]
        nonzero = ((c.Cp[j] - c.Cp[i]) > 0) | (c.Cp[L] <= 0) | c.idle_stages  # no 0-ms stage
        share = np.clip((c.Wshare_num[j] - c.Wshare_num[i])
                        / np.where(c.Wshare_den[j] > c.Wshare_den[i], c.Wshare_den[j] - c.Wshare_den[i], 1.0),
                        0.0, 1.0)
        if i == 0:
            share = np.ones_like(share)  # the first stage sends no gradient: all of it is W
        # the hops before layer i, per devices of the suffix: at least the one into it and, with
        # the cross-stage conditions, the prefix's (`_prefix_hops`); (P+1, D+1) per the stage's
        # group with node groups, else (2, D+1) [inter, fast]
        if P > 1:  # per the devices e of the stage's group: fast only if the stage before joins
            ge = np.arange(P + 1)
            hops_in = np.broadcast_to(np.where(ge + 1 <= P, c.into_ms[1, i], c.into_ms[0, i])[:, None],
                                      (P + 1, D + 1))
            if pre is not None:  # a prefix whose last group has room for e more devices
                Xi = pre[i]  # (D+1, P+1)
                slow = np.maximum(c.into_ms[0, i], Xi[:, 0])
                most = np.minimum.accumulate(Xi[:, 1:], axis=1)  # [:, g - 1]: groups of 1..g devices
                fast = np.full((P + 1, D + 1), np.inf)
                for e in range(1, P):
                    fast[e] = np.maximum(c.into_ms[1, i], most[:, P - e - 1])
                hops_in = np.minimum(slow[None, :], fast)
        else:
            hops_in = np.broadcast_to(c.into_ms[:, i][:, None], (2, D + 1))
            if pre is not None:
                hops_in = np.maximum(hops_in, pre[i][None, :])
        H = c.HF[i] + hops_in
        Tl = (np.where(i > 0, c.first_bwd_lo, 0.0) if zb else c.HB[i]) + hops_in
        peak = np.maximum.accumulate(c.layer_act[i:i + J])  # (J,)
        skip = c.skip_ms[i, j]  # (J,)
        # with the cross-stage conditions, what each stage [i, j) receives from each layer
        # before it (`skip_arrivals`): (1, J, 1) against H and Tl
        if cross and c.skip_in is not None:
            s_in, s_out = c.skip_in[i, j][None, :, None], c.skip_out[i, j][None, :, None]
        else:
            s_in = s_out = None
        gj = g[j]  # (J, D+1, P+1, Q)
        gj_any = gj.min(axis=2)  # a slow hop into the suffix: its group does not matter
        gj_arg = gj.argmin(axis=2)
        cls_j = c.klass[i, j] if Q > 1 else np.zeros(J, dtype=int)  # each stage [i, j)'s class
        cls_cols = [(q, np.nonzero(cls_j == q)[0]) for q in np.unique(cls_j)]
        zj = z[j]
        zj_any = zj.min(axis=2)
        yj, uj = (y[j], u[j]) if paths else (None, None)
        yj_any, uj_any = (yj.min(axis=2), uj.min(axis=2)) if paths else (None, None)
        zvj = zv[j] if vec else None
        zvj_any = zvj.min(axis=2) if vec else None
        best = np.full((D + 1, P + 1, Q), np.inf)
        best_z = np.full((D + 1, P + 1), np.inf)
        best_y = np.full((D + 1, P + 1), np.inf)
        best_u = np.full((D + 1, P + 1), np.inf)
        best_zv = np.full((D + 1, P + 1, M), np.inf)
        for v, rs, n, dd, flat_link, ar_gbps, w, (ra, starts, dda, valida, idxa, inflight), (mine, after, klass), \
                w_least in per_variant:
            if len(rs) == 0:
                continue
            fwd, crit, wgt, comp, (static, params), act = _stage_costs(c, v, i, j, share, zb)
            transient = peak if v.recompute else 0.0
            ar = np.stack([_allreduce_ms(params, int(r), float(bw), c.latency_us)
                           for r, bw in zip(rs, ar_gbps, strict=True)])  # (R, J)
            ar = ar + v.optimizer_ms(i, j)  # the stage's tail: all-reduce, then optimizer step
            # memory per replica count (Ra, J, D+1); a choice's stage is priced with its own
            # r (the smallest of its n: the most in flight, the cheapest all-reduce), its
            # suffix is the best behind any r of that n that fits (`replica_choices`)
            room = c.memory_bytes - (static + transient)  # (J,): for activations
            cap = np.divide(room, act, out=np.where(room >= 0, np.inf, -1.0), where=act > 0)
            fits = (inflight[:, None, :] <= cap[None, :, None]) & nonzero[None, :, None] & valida[:, None, :]

            f2, c2, w2 = fwd[None, :, None], crit[None, :, None], wgt[None, :, None]

            # transitions: (replica choices, the suffix's round trip behind the hop, fast
            # link?, this stage's group per choice, the suffix's group per choice or None for
            # the best of any group). First a slow hop into any suffix, then a fast hop into a
            # suffix whose first group has room for this stage.
            rows_all = np.arange(len(rs))
            per_r, nxt = zip(*(_behind(fits, gj_any[:, :, q], dda, starts) for q in range(Q)), strict=True)
            moves = [(rows_all, nxt, _behind(fits, zj_any, dda, starts)[1] if cross else None,
                      _behind(fits, yj_any, dda, starts)[1] if paths else None,
                      _behind(fits, uj_any, dda, starts)[1] if paths else None,
                      _behind_each(fits, zvj_any, dda) if vec else None,
                      flat_link if P == 1 else np.zeros(len(rs), dtype=int), np.minimum(dd, P), None, per_r)]
            for e_next in range(1, P):
                K = int(np.searchsorted(dda, P - e_next, side="right"))  # the r that fit the group
                if K:
                    rows = np.arange(int(np.searchsorted(starts, K)))  # the choices with one of them
                    sub = (fits[:K], dda[:K], starts[rows])
                    per_r, nxt = zip(*(_behind(sub[0], gj[:, :, e_next, q], *sub[1:]) for q in range(Q)),
                                     strict=True)
                    moves.append((rows, nxt, _behind(sub[0], zj[:, :, e_next], *sub[1:])[1] if cross else None,
                                  _behind(sub[0], yj[:, :, e_next], *sub[1:])[1] if paths else None,
                                  _behind(sub[0], uj[:, :, e_next], *sub[1:])[1] if paths else None,
                                  _behind_each(sub[0], zvj[:, :, e_next], sub[1]) if vec else None,
                                  np.ones(len(rows), dtype=int), dd[rows] + e_next, e_next, per_r))
            for rows, nxts, nxt_z, nxt_y, nxt_u, nxt_zv, fast, e_new, e_next, per_rs in moves:
                nn, ww = n[rows], w[rows]
                hop = c.hop_ms[fast, i][:, j]  # (rows, J)
                if Q == 1:
                    nxt, per_r, q_of = nxts[0], per_rs[0], None
                    rt = (fwd + crit)[None, :, None] + np.where(last_j, 2 * hop[:, :, None], 0.0) + nxt
                else:  # behind the suffix of each class, the hop of that class (`hop_classes`)
                    behind = np.stack([np.where(last_j, 2 * (hop if q == 0 else c.hop_more_ms[q - 1, fast, i][:, j])
                                                [:, :, None], 0.0) + nxts[q] for q in range(Q)])
                    q_of = behind.argmin(axis=0)  # (rows, J, D+1)
                    nxt = np.min(nxts, axis=0)
                    rt = (fwd + crit)[None, :, None] + behind.min(axis=0)
                if cross:  # (kept apart: the same sums as without, to the last bit)
                    rt = np.maximum(rt, (fwd + crit)[None, :, None] + skip[None, :, None])
                # the busiest replica's n microbatches, with its round trips (module docstring);
                # `crit` ends at its last B, `full` at its last W (the same but for zb-h1)
                first, last, crit_busy = _busy(nn, ww, f2, c2, rt)
                if paths:
                    # the first microbatch's backward waits for this stage's warm-up forwards
                    # (at least the fewest it runs) and for the next stage's first backward
                    # (`u`); the forwards after it follow one backward each
                    rt0 = np.maximum(np.maximum(rt, w_least[rows] * f2 + c2),
                                     (fwd + crit)[None, :, None] + np.where(last_j, 2 * hop[:, :, None], 0.0) + nxt_u)
                    first = np.maximum(first, rt0 + (nn - 1) * c2 + (nn - ww) * f2)
                    last = np.maximum(last, np.where(ww < nn, rt0 + (nn - 1 - ww) * (f2 + c2), 0.0) + rt)
                    crit_busy = np.maximum(crit_busy, np.maximum(first, last))
                full_busy = np.maximum(np.maximum(nn * comp[None, :, None], first + nn * w2), last + w2)
                # the hop into this stage is fast only if the stage before joins its group
                into = np.minimum(e_new, P) if P > 1 else fast  # a row of H and Tl
                Hs, Ts = H[into][:, None, :], Tl[into][:, None, :]  # (rows, 1 or J, D+1)
                if s_in is not None:
                    Hs, Ts = np.maximum(Hs, s_in), np.maximum(Ts, s_out)
                t_stage = Hs + np.maximum(crit_busy + Ts, full_busy + ar[rows][:, :, None])
                if cross:
                    # this stage's last B: after its own n microbatches and after its
                    # successor's last B (that microbatch's gradient comes back); then the
                    # backward of the layers before it, and its all-reduce
                    end_b = np.maximum(Hs + crit_busy,
                                       nxt_z + np.where(last_j, hop[:, :, None], 0.0) + c2)
                    t_stage = np.maximum(t_stage, end_b + np.maximum(Ts, ar[rows][:, :, None]))
                if paths:
                    # the last microbatch, m - 1, is the last of a busiest replica (round
                    # robin): its forward starts here no earlier than `last - rt` after H, and
                    # from there every stage after it still waits for it (their all-reduces
                    # after its backward): the suffix's least tail behind the hop
                    down = f2 + np.where(last_j, hop[:, :, None], 0.0) + nxt_y
                    t_stage = np.maximum(t_stage, Hs + last - rt + down)
                    y_here = np.maximum(rt + np.maximum(Ts, w2 + ar[rows][:, :, None]), down)
                if vec:
                    # per replica count (Ra'; its choice `of`, a row: `rows` counts from 0):
                    # microbatch q's gradient from the next stage, then the backward of q and
                    # of every later microbatch of q's replica; and when q's backward ends, for
                    # the stage before. Each the least over the replica counts of a choice
                    Ra = len(nxt_zv)
                    of = klass[:Ra]
                    back = nxt_zv + np.where(last_j, hop[of][:, :, None], 0.0)[..., None]  # (Ra, J, D+1, M)
                    tail = _class_min((back + c2[..., None] * after[:Ra, None, None, :]).max(axis=3),
                                      starts[rows], len(rows))
                    t_stage = np.maximum(t_stage, tail + np.maximum(Ts, ar[rows][:, :, None]))
                    Hq = Hs[of]  # (Ra, 1 or J, D+1)
                    end_q = _class_min(np.maximum(back + c2[..., None], Hq[..., None]
                                                  + mine[:Ra, None, None, :] * (f2 + c2)[..., None]),
                                       starts[rows], len(rows))
                ok = (t_stage <= T) & np.isfinite(nxt)
                if edges is not None:
                    edges.record(i, ok, rows, per_r if Q == 1 else np.min(per_rs, axis=0), starts, ra, j, v.tp)
                val = np.where(ok, rt, np.inf)
                for e in np.unique(e_new):  # fold into best[:, e, class]: replica-major, then j
                    sel = np.nonzero(e_new == e)[0]
                    for cq, cols in cls_cols:
                        flat = (val[sel] if Q == 1 else val[sel][:, cols]).reshape(-1, D + 1)
                        k = np.argmin(flat, axis=0)
                        vbest = flat[k, np.arange(D + 1)]
                        better = vbest < best[:, e, cq]
                        if want_plan:
                            for d in np.nonzero(better)[0]:
                                ri, jc = divmod(int(k[d]), len(cols))
                                jj = int(cols[jc])
                                nq = 0 if q_of is None else int(q_of[sel[ri], jj, d])  # the suffix's class
                                q = int(rows[sel[ri]])  # the choice; its r whose suffix was taken:
                                end = int(starts[q + 1]) if q + 1 < len(starts) else len(ra)
                                members = slice(int(starts[q]), min(end, per_rs[nq].shape[0]))
                                a = int(starts[q]) + int(np.argmin(per_rs[nq][members, jj, d]))
                                nxt_e = e_next if e_next is not None else int(gj_arg[jj, int(idxa[a, d]), nq])
                                choice[(i, int(d), int(e), int(cq))] = (int(j[jj]), int(ra[a]), v.tp, v.recompute,
                                                                        nxt_e, nq)
                        best[:, e, cq] = np.where(better, vbest, best[:, e, cq])
                    if cross:
                        _fold_least(best_z[:, e], ok, end_b, sel)
                    if paths:
                        _fold_least(best_y[:, e], ok, y_here, sel)
                        _fold_least(best_u[:, e], ok, rt0, sel)
                    if vec:
                        best_zv[:, e] = np.minimum(best_zv[:, e], np.where(ok[..., None], end_q, np.inf)[sel]
                                                   .reshape(-1, D + 1, M).min(axis=0))
        g[i] = best
        z[i] = best_z
        y[i] = best_y
        u[i] = best_u
        zv[i] = best_zv
    return g, choice


class TooManyStages(Exception):
    """`StageEdges` reached its cap: the DP allows too many stages to enumerate its plans."""


class StageEdges:
    """Every stage the DP allows at T (`_suffix_dp(edges=...)`), for `exhaust`: `by_state[(i,
    d)]` = {(j, r, tp)}: a stage of layers [i, j) with r replicas of TP degree tp, first of a
    suffix on d devices, whose conditions hold behind the best suffix of its replica choice
    (a relaxation: the suffix actually taken may be slower) and whose own suffix (j, d - r
    tp) exists. Every plan meeting the conditions at T is a path of these (its node groups
    and recomputation aside)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.count = cap, 0
        self.by_state: dict[tuple[int, int], set[tuple[int, int, int]]] = {}

    def record(self, i: int, ok: np.ndarray, rows: np.ndarray, per_r: np.ndarray,
               starts: np.ndarray, ra: np.ndarray, j: np.ndarray, tp: int) -> None:
        """The allowed entries `ok` (choice rows, J, D+1) of one transition of `_suffix_dp`:
        each replica count of an allowed choice whose suffix exists (`per_r` finite)."""
        for ri, jj, d in zip(*np.nonzero(ok), strict=True):
            q = int(rows[ri])
            end = int(starts[q + 1]) if q + 1 < len(starts) else len(ra)
            here = self.by_state.setdefault((i, int(d)), set())
            before = len(here)
            here.update((int(j[jj]), int(ra[a]), tp) for a in range(int(starts[q]), min(end, per_r.shape[0]))
                        if np.isfinite(per_r[a, jj, d]))
            self.count += len(here) - before
            if self.count > self.cap:
                raise TooManyStages


def without_classes(c: Conditions) -> Conditions:
    """`c` with one hop class (`hop_classes`): every hop priced with what layer j reads."""
    return replace(c, klass=None, hop_more_ms=None)


def safe_conditions(c: Conditions, degree: int | None = None) -> Conditions | None:
    """`c` with memory priced pessimistically, no recomputed variants (the search adds
    recomputation itself) and, with `degree`, every stage at that TP degree: the DP's plan
    then fits memory as the simulator counts it. None if no variant is left."""
    vs = tuple(v for v in c.variants if not v.recompute and (degree is None or v.tp == degree))
    return replace(c, pessimistic=True, variants=vs, grouped=False) if vs else None


PlanTuple = tuple[tuple[int, ...], ...]  # `plan_at`'s (bounds, replicas, tp degrees, recompute)


def plan_at(c: Conditions, T: float) -> PlanTuple | None:
    with np.errstate(invalid="ignore"):
        g, choice = _suffix_dp(c, T, want_plan=True)
    finite = np.nonzero(np.isfinite(g[0]).any(axis=(1, 2)))[0]
    if len(finite) == 0:
        return None
    d = int(finite[0])  # the fewest devices
    e, q = (int(x) for x in np.unravel_index(np.argmin(g[0, d]), g[0, d].shape))
    bounds, reps, tps, rcs, i = [0], [], [], [], 0
    while i < c.L:
        j, r, t, rc, e, q = choice[(i, d, e, q)]
        bounds.append(j)
        reps.append(r)
        tps.append(t)
        rcs.append(rc)
        i, d = j, d - r * t
    return tuple(bounds), tuple(reps), tuple(tps), tuple(rcs)


def allowed_stages(c: Conditions, T: float, cap: int) -> StageEdges:
    """Every stage the DP allows at T (`StageEdges`); raises `TooManyStages` past `cap`."""
    edges = StageEdges(cap)
    with np.errstate(invalid="ignore"):  # inf * 0 where no suffix exists: masked anyway
        _suffix_dp(c, T, edges=edges)
    return edges


def feasible(c: Conditions, T: float) -> bool:
    with np.errstate(invalid="ignore"):  # inf * 0 where no suffix exists: masked anyway
        g, _ = _suffix_dp(c, T)
    return bool(np.isfinite(g[0]).any())


# The work of one `_suffix_dp` call in the search's units (about one simulated action each,
# `planner.search.local.Budget`): a fixed cost per (layer, variant) and one per cell of its
# (replica choice, last layer, devices) arrays, fitted on our 2-core machine (107 us and
# 16 ns; within 25 % on the plan-quality profiles). Counting it keeps the bound's bisection
# inside the deterministic budget. Looking up the suffix behind every replica count of a
# choice's n (`_behind`) made a DP 17 % slower (median of 16 DPs on 8 profiles, timed side
# by side with the DP before it): both scaled by 1.17.
DP_ITER_WORK = 50.0
DP_CELL_WORK = 1 / 128
# per hop class above one (`hop_classes`): a DP with 2 classes took 1.41-1.73x one without, with
# 3 classes 1.66-1.83x (medians of 3, side by side, on ResNet-50, SqueezeNet, GNMT, U-Net)
CLASS_WORK = 0.45


def dp_work(c: Conditions) -> int:
    """The work of one feasibility test (one DP over every layer) of `c`: with node groups,
    one more pass per (replica choice, room left in the suffix's first group)."""
    P = _group_size(c)
    iters = cells = 0
    pairs = band_cells(c)
    for v in c.variants:
        dd = c.rs[c.rs * v.tp <= c.D] * v.tp  # (not `variant_choices`: see there)
        if len(dd):
            rows = len(dd) + sum(int((dd + e <= P).sum()) for e in range(1, P))
            iters += c.L * (1 + sum(1 for e in range(1, P) if (dd + e <= P).any()))
            cells += rows * pairs * (c.D + 1)
    return int((DP_ITER_WORK * iters + DP_CELL_WORK * cells) * (1 + CLASS_WORK * (c.hop_classes - 1))) + 1


def lower_bound(c: Conditions, upper_ms: float, rel_tol: float = 1e-4, max_steps: int = 40,
                lower_ms: float = 0.0, max_work: float = math.inf
                ) -> tuple[BoundPlan | None, int]:
    """The smallest T (to `rel_tol`) at which some plan meets every condition, with that plan
    (None when no plan fits memory at any time), and the work spent (`dp_work` per DP).

    `lower_ms`: a time no plan beats (the bisection starts there; the result stays a bound).
    `max_work`: the bisection stops when its next step and the final plan would pass it; the
    bound is then the largest time found infeasible, still a bound, only a looser one.

    With node groups (`c.grouped`), the cheaper DP without them bisects first; its time is a
    bound for the grouped DP too, which then bisects only above it, if at all."""

    P = _group_size(c)
    if P == 1:
        return _bisect(c, upper_ms, rel_tol, max_steps, lower_ms, max_work)
    found, spent = _bisect(replace(c, grouped=False), upper_ms, rel_tol, max_steps, lower_ms, max_work)
    if found is None or spent + 2 * dp_work(c) > max_work:
        return found, spent
    T = found.bound_ms * (1 + rel_tol)  # the grouped DP's plan where the flat one is feasible
    spent += dp_work(c)
    if feasible(c, T):
        plan = plan_at(c, T)
        assert plan is not None
        return BoundPlan(found.bound_ms, *plan), spent + dp_work(c)
    more, used = _bisect(c, upper_ms, rel_tol, max_steps, T, max_work - spent, lower_fails=True)
    return (more if more is not None else found), spent + used


def _bisect(c: Conditions, upper_ms: float, rel_tol: float, max_steps: int, lower_ms: float,
            max_work: float, lower_fails: bool = False) -> tuple[BoundPlan | None, int]:
    """`lower_fails`: `lower_ms` is known infeasible (not tested again)."""
    step = dp_work(c)
    spent = 0

    def test(T: float) -> bool:
        nonlocal spent
        spent += step
        return feasible(c, T)

    total = c.HF[c.L] + c.HB[c.L]
    hi = upper_ms if math.isfinite(upper_ms) else total * c.m * 4
    if not test(hi):
        hi2 = hi * 1e6
        if not test(hi2):
            return None, spent
        hi = hi2
    lo = min(max(total, lower_ms), hi)  # one microbatch through the whole model, fastest device
    if lo == hi or (not lower_fails and test(lo)):
        plan = plan_at(c, lo)
        assert plan is not None
        return BoundPlan(lo, *plan), spent + step
    for _ in range(max_steps):
        if hi - lo <= rel_tol * hi or spent + 2 * step > max_work:
            break
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        if test(mid):
            hi = mid
        else:
            lo = mid
    plan = plan_at(c, hi)
    assert plan is not None
    return BoundPlan(lo, *plan), spent + step


LAST_BACKWARD_WORK = 1.3  # a DP with the cross-stage conditions, against one without
# with the first and last microbatch's paths (`Conditions.microbatch_paths`) against without
# (the cross-stage DP measured 1.7-1.9x the plain one on chain100, GNMT, ResNet-50 and VGG-16,
# 2.4x on chain200, against 1.3x without them)
MICROBATCH_PATHS_WORK = 1.4
# the prefix DP with node groups of P devices against one DP without groups: 1 + this x (P - 1)
# (measured 1.5x at P = 4 on GNMT; 2.2-3.4x at P = 8 on VGG-16, ResNet-50, 100- and 200-layer chains)
PREFIX_GROUP_WORK = 0.35
PROBE_GAP = 0.1  # below this gap `tighten` probes just below the plan first, above it bisects
PROOF_GAP = 0.0099  # the gap issue 10 asks to prove (1 %), a hair inside it
# a DP with each microbatch's last backward (`Conditions.per_microbatch`) against one with the
# cross-stage conditions only, per microbatch: 1 + this x m (measured 7-14x at m = 16 on GNMT,
# ResNet-50 and the 100- and 200-layer chains; 1.6x on 6 layers)
PER_MICROBATCH_WORK = 0.5
# tracking a few microbatches (`Conditions.tracked`) costs more than their count says: 1.3-1.9x
# the cross-stage DP for one, 1.6-3.0x for four (min of 3, on chain100, vgg16, GNMT, ResNet-18)
PER_MICROBATCH_LEAST = 3


def tighten_step_work(c: Conditions) -> int:
    """The work of one feasibility test with the cross-stage conditions (`tighten`): the
    suffix DP with them, and the prefix DP (`_prefix_hops`), which costs about one DP without
    node groups where there are none (measured 1.6-2.0x the DP without the cross-stage
    conditions, on resnet50, gnmt, chain200 and densenet121), more per group state
    (PREFIX_GROUP_WORK)."""
    prefix = 0
    if c.prefix_hops:  # without classes; with node groups, a state per group fill; a row per
        # replica count where the suffix DP has one per replica choice (`_prefix_hops`)
        counts = sum(len(replica_counts(c, v)) for v in c.variants)
        choices = sum(int((c.rs * v.tp <= c.D).sum()) for v in c.variants)
        rows = counts / choices if choices else 1.0
        prefix = dp_work(replace(without_classes(c), grouped=False)) * (1 + PREFIX_GROUP_WORK * (_group_size(c) - 1)) * rows
    suffix = dp_work(c) * LAST_BACKWARD_WORK * (MICROBATCH_PATHS_WORK if c.microbatch_paths else 1.0)
    if c.per_microbatch:
        suffix *= 1 + PER_MICROBATCH_WORK * max(len(c.tracked) or c.m, PER_MICROBATCH_LEAST)
    return int(suffix + prefix) + 1


def steps_to_prove(lo: float, hi: float) -> int:
    """Geometric bisection steps from [lo, hi] until the interval is within PROOF_GAP."""
    if lo <= 0:
        return 64
    ratio = math.log(hi) - math.log(lo)  # (hi / lo overflows where lo is subnormal)
    target = -math.log1p(-PROOF_GAP)
    return 0 if ratio <= target else math.ceil(math.log2(ratio / target))


def restrict(c: Conditions, cuts: np.ndarray) -> Conditions:
    """`c` with stage boundaries only at `cuts` (sorted layer indices from 0 to L): a
    restriction, not a relaxation. Every plan of it is a plan of `c` meeting the same
    conditions, so where it is feasible at T, `c` is too: its smallest feasible T is an upper
    estimate of `c`'s, at about (len(cuts) / L)^2 of the work."""
    cuts = np.asarray(cuts)
    assert cuts[0] == 0 and cuts[-1] == c.L and bool(np.all(np.diff(cuts) > 0)), "cuts: 0 < ... < L"
    vs = tuple(Variant(v.tp, v.recompute, v.Fp[cuts], v.Bp[cuts], v.Pp[cuts], v.Ap[cuts],
                       None if v.Zp is None else v.Zp[cuts], None if v.Op is None else v.Op[cuts])
               for v in c.variants)
    return replace(
        c, L=len(cuts) - 1, variants=vs, Cp=c.Cp[cuts], Wshare_num=c.Wshare_num[cuts],
        Wshare_den=c.Wshare_den[cuts], HF=c.HF[cuts], HB=c.HB[cuts], kept_lo=c.kept_lo[cuts],
        layer_act=np.maximum.reduceat(c.layer_act, cuts[:-1]), hop_ms=c.hop_ms[:, cuts][:, :, cuts],
        into_ms=c.into_ms[:, cuts], skip_ms=c.skip_ms[np.ix_(cuts, cuts)],
        klass=None if c.klass is None else c.klass[np.ix_(cuts, cuts)],
        hop_more_ms=None if c.hop_more_ms is None else c.hop_more_ms[:, :, cuts][:, :, :, cuts],
        skip_in=None if c.skip_in is None else c.skip_in[np.ix_(cuts, cuts)],
        skip_out=None if c.skip_out is None else c.skip_out[np.ix_(cuts, cuts)])


def coarse_grid(c: Conditions, step_work: Callable[[Conditions], int], steps: int, allowed: float
                ) -> tuple[int, np.ndarray, Conditions, int] | None:
    """The finest grid of cuts at every k-th layer (k a power of two, at least 2, with at least
    two stages: L // k >= 2) on which `steps` steps of `c` restricted to it (`restrict`) fit
    `allowed`, one step costing `step_work(restricted)`: (k, its cuts, the restricted
    conditions, one step's work); None where no grid does."""
    k = 2
    while c.L // k >= 2:
        cuts = np.unique(np.r_[np.arange(0, c.L, k), c.L])
        coarse = restrict(c, cuts)
        work = step_work(coarse)
        if steps * work <= allowed:
            return k, cuts, coarse, work
        k *= 2
    return None


def in_layers(cuts: np.ndarray, plan: PlanTuple) -> PlanTuple:
    """A plan of `restrict(c, cuts)` as a plan of `c`: its boundaries as layers."""
    return (tuple(int(cuts[i]) for i in plan[0]), *plan[1:])


COARSE_SHARE = 0.25  # of `tighten`'s work at most for the coarse bisections of a scarce budget
COARSE_STEPS = 10  # per grid
NEAR_ABOVE = 0.05  # a restricted DP with a plan this close above the plan found is informative


def _narrow(cz: Conditions, lo: float, hi: float, allowed: float, deadline: float,
            feasible_at: list[tuple[float, PlanTuple]] | None = None
            ) -> tuple[float, int, bool]:
    """Where `tighten` affords few steps: an upper estimate of the smallest feasible T of `cz`
    (`hi` itself if none below it is found), the work spent, and whether the estimate is
    informative: a restricted DP has a plan at most NEAR_ABOVE above `hi`. (Cut only every k
    layers, a DP may have none at any time when memory is tight; that says nothing about
    `cz`.) Bisects `cz` restricted to every k-th layer (`restrict`, the smallest k whose
    COARSE_STEPS steps fit half of `allowed`), then to that grid plus every layer within k of
    the boundaries of the plan it found, where the plans of `cz` near that time cut. That
    plan (a plan of `cz`, in its layers) goes to `feasible_at` if given, as in `tighten`."""
    L = cz.L
    grid = coarse_grid(cz, tighten_step_work, 2 * COARSE_STEPS, allowed)
    if grid is None:
        return hi, 0, False
    k, cuts, cc, cstep = grid
    spent = cstep
    ceiling = hi * (1 + NEAR_ABOVE)
    if time.perf_counter() >= deadline or not feasible(cc, ceiling):
        return hi, spent, False

    def bisect(cc: Conditions, cstep: int) -> float:
        """The least feasible time found on one grid, from `ceiling` down (a time infeasible
        on one grid may not be on a finer one, so each grid starts from `lo` again)."""
        nonlocal spent
        top, low = ceiling, lo
        for _ in range(COARSE_STEPS):
            if top - low <= 1e-3 * top or spent + cstep > allowed or time.perf_counter() >= deadline:
                break
            mid = math.sqrt(low * top) if low > 0 else top / 2
            spent += cstep
            if feasible(cc, mid):
                top = mid
            else:
                low = mid
        return top

    top = bisect(cc, cstep)
    plan = None
    if spent + cstep <= allowed:  # the restricted plan to refine around (one DP more)
        spent += cstep
        plan = plan_at(cc, top)
    if plan is not None:
        if feasible_at is not None:
            feasible_at.append((top, in_layers(cuts, plan)))
        near = [np.arange(max(0, b - k + 1), min(L, b + k)) for b in cuts[list(plan[0][1:-1])]]
        fine = restrict(cz, np.unique(np.concatenate([cuts, *near])))
        top = min(top, bisect(fine, tighten_step_work(fine)))
    return min(hi, top), spent, True


def tighten(c: Conditions, lower_ms: float, upper_ms: float, max_work: float,
            rel_tol: float = 1e-4, deadline: float = math.inf, upper_feasible: bool = False,
            per_microbatch: bool = True,
            feasible_at: list[tuple[float, PlanTuple]] | None = None,
            classed: Conditions | None = None) -> tuple[float, int]:
    """A bound at least `lower_ms` (a bound of `c`) from the DP with the cross-stage
    conditions as well, bisected between `lower_ms` and `upper_ms` (the best plan found) within
    `max_work`; and the work spent. Where the gap is under PROBE_GAP, it probes just below
    `upper_ms` first (a small gap is proven in a step or two). Where `max_work` affords fewer
    steps than bisection needs to come within PROOF_GAP, the work left over from whole steps
    bisects DPs restricted to some cuts (`_narrow`): if they have a plan a little above
    `upper_ms` but none PROOF_GAP below it, the first step probes there (one step proves the
    1 %); else it bisects as it would without them (aiming the step below a restricted
    plan's time gained on some instances and lost as much on others: not kept). `upper_ms`
    itself when no plan of `c` is that fast (not tested when `upper_feasible`: a plan of `c`
    takes that long). Stops at `deadline` (`time.perf_counter()`), the wall-clock safety net,
    with the bound so far. Node groups only where four steps of them fit `max_work` (they
    cost 2-9x); the prefix's hops (`_prefix_hops`, about one DP more per step) only where
    `max_work` affords the steps to prove the 1 % with them (on hundreds of layers the steps
    are few and `_narrow` needs them more). `feasible_at` (if given) gets every time a step
    found feasible, with the DP's plan there (`plan_at`: the same DP, 0-5 % more work).
    `classed`: `c` with its hop classes, where the caller dropped them for more steps: the
    probe just below the plan (where `_narrow` says one step may prove the 1 %) runs with them
    if the work affords it (they price what a cut inside a residual block sends on: ResNet-101
    on 16 devices at 1 GB/s, 26.1 % -> 0.99 %, where that probe without them found a plan)."""
    cz = replace(c, cross_stage=True, prefix_hops=False)
    step = tighten_step_work(cz)
    if c.grouped and 4 * step > max_work:
        cz = replace(cz, grouped=False)
        step = tighten_step_work(cz)
    spent = 0
    lo, hi = lower_ms, upper_ms
    if hi <= lo or not math.isfinite(hi):
        return lo, 0
    with_hops = replace(cz, prefix_hops=True)
    if not math.isfinite(max_work) or max_work // tighten_step_work(with_hops) >= steps_to_prove(lo, hi):
        # the prefix's hops where the work affords the steps to prove the 1 % with them
        cz, step = with_hops, tighten_step_work(with_hops)
        with_paths = replace(cz, microbatch_paths=True)  # and then the microbatches' paths
        if not math.isfinite(max_work) or max_work // tighten_step_work(with_paths) >= steps_to_prove(lo, hi):
            cz, step = with_paths, tighten_step_work(with_paths)
    first = not upper_feasible  # this microbatch size may have no plan as fast: bisect
    steps = int(max_work // step) if math.isfinite(max_work) else 1 << 30
    scarce = not first and step <= max_work and steps < steps_to_prove(lo, hi)
    probes = [1e-3, PROOF_GAP]
    probe_c: Conditions | None = None  # the classed conditions for the probe below the plan
    probe_step = 0
    if scarce:
        # the work no full step can use (at most COARSE_SHARE) finds where plans of `cz` are
        hi_c, spent, informative = _narrow(
            cz, lo, hi, min(COARSE_SHARE * max_work, max_work - steps * step), deadline, feasible_at)
        if informative and hi_c >= hi * (1 - PROOF_GAP):
            probes = [PROOF_GAP]  # none 1 % below the plan, one a little above: try the 1 %
            if classed is not None:
                pc = replace(classed, cross_stage=True, prefix_hops=cz.prefix_hops,
                             microbatch_paths=cz.microbatch_paths, grouped=cz.grouped)
                if spent + (probe_step := tighten_step_work(pc)) <= max_work:
                    probe_c = pc
        else:
            scarce = False  # the 1 % cannot be proven, or nothing says it can: bisect
    while hi - lo > rel_tol * hi and spent + step <= max_work and time.perf_counter() < deadline:
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        here, cost = cz, step
        if first:
            mid = hi  # no plan of this microbatch size may be as fast as the best found
            first = False
        elif scarce or hi - lo < PROBE_GAP * hi:
            while probes:  # just below the plan
                near = upper_ms * (1 - probes.pop(0))
                if mid < near < hi:
                    mid = near
                    if probe_c is not None:  # (set only where PROOF_GAP is the one probe)
                        # a plan of it is a plan of `cz`: the bisection goes on with `cz`
                        here, cost, probe_c = probe_c, probe_step, None
                    break
        spent += cost
        if feasible_at is None:
            ok = feasible(here, mid)
        elif ok := (plan := plan_at(here, mid)) is not None:
            feasible_at.append((mid, plan))
        if ok:
            hi = mid
        else:
            lo = mid
    if per_microbatch and lo < upper_ms * (1 - PROOF_GAP):
        got, used = _per_microbatch(cz, lo, upper_ms, max_work - spent, rel_tol, deadline)
        lo, spent = max(lo, got), spent + used
    return lo, spent


PER_MICROBATCH_CELLS = 3e7  # the largest per-microbatch array `_per_microbatch` builds (8 bytes each)


def per_microbatch_cells(c: Conditions) -> int:
    """The entries of the largest array of a DP with each microbatch's last backward: the
    suffix table (layers x devices x node group x microbatches), or one layer's transitions
    (replica counts x layers x devices x microbatches)."""
    table = (c.L + 1) * (c.D + 1) * (_group_size(c) + 1) * c.m
    step = min(c.D, c.m) * c.L * (c.D + 1) * c.m
    return max(table, step)


def proof_conditions(c: Conditions) -> Conditions:
    """`c` with every condition the bound has: the cross-stage ones, the prefix's hops and,
    where its arrays are not too large, each microbatch's last backward."""
    cz = replace(c, cross_stage=True, prefix_hops=True, per_microbatch=True)
    return cz if per_microbatch_cells(cz) <= PER_MICROBATCH_CELLS else replace(cz, per_microbatch=False)


def proof_sets(m: int) -> list[tuple[int, ...]]:
    """The microbatches `prove` tracks, cheapest first: the last one, four spread out (the
    last of each quarter), then all (empty)."""
    out: list[tuple[int, ...]] = [(m - 1,)]
    spread = tuple(sorted({max(0, (k * m) // 4 - 1) for k in range(1, 5)}))
    if 1 < len(spread) < m:
        out.append(spread)
    out.append(())
    return out


def prove(c: Conditions, T: float, max_work: float, deadline: float = math.inf) -> tuple[bool, int]:
    """Whether every condition of the bound, each microbatch's last backward included, fails
    at T (then no plan is faster than T), and the work spent: the DP tracking a few
    microbatches first (`proof_sets`; a subset of the conditions is a relaxation, so one
    failing at T proves it), then more, while `max_work` affords them. False where none
    fails. (On the plan-quality suite the last microbatch alone proves most of what all of
    them prove, at a quarter to a half of the work.)"""
    cz = proof_conditions(c)
    if not cz.per_microbatch:
        return False, 0
    spent = 0
    sets = [replace(cz, tracked=tracked) for tracked in proof_sets(cz.m)]
    steps = [tighten_step_work(cv) for cv in sets]
    for k, cv in enumerate(sets):
        if spent + steps[k] > max_work or time.perf_counter() >= deadline:
            break  # the sets cost more and more
        # each set holds the conditions of the sets before it: where testing this one would
        # leave too little for a larger one that the work affords alone, test that one instead
        # (it proves whatever this one would: chain100 on 2 x 8 devices, where the last
        # microbatch alone fails and four prove the 1 % at 1.2x its work)
        if any(spent + steps[k] + steps[x] > max_work >= spent + steps[x] for x in range(k + 1, len(sets))):
            continue
        spent += steps[k]
        if not feasible(cv, T):
            return True, spent
    return False, spent


def _per_microbatch(cz: Conditions, lo: float, upper_ms: float, max_work: float, rel_tol: float,
                    deadline: float) -> tuple[float, int]:
    """`tighten`'s second part, on the work it left: the same conditions and each
    microbatch's last backward as well (`Conditions.per_microbatch`), bisected from `lo`
    (infeasible without them, so with them too) up to the plan found (a plan of `cz` takes
    that long, so it meets them), just below the plan first (one step may prove the 1 %).
    Where tight memory leaves a replicated stage few microbatches, the one that sets the time
    is often not the last: its gradient waits for the next stage's replica to run the
    microbatches before it (the GPT example on 16 devices, tight memory: 857.9 -> 927.6 ms,
    against a plan of 932.7)."""
    cv = replace(cz, per_microbatch=True)
    if per_microbatch_cells(cv) > PER_MICROBATCH_CELLS:
        return lo, 0  # its arrays would not fit memory (a long --time-limit on a large instance)
    step = tighten_step_work(cv)
    spent = 0
    hi = upper_ms
    probes = [PROOF_GAP]
    while hi - lo > rel_tol * hi and spent + step <= max_work and time.perf_counter() < deadline:
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        while probes:
            near = upper_ms * (1 - probes.pop(0))
            if lo < near < hi:
                mid = near
        spent += step
        if feasible(cv, mid):
            hi = mid
        else:
            lo = mid
    return lo, spent


__all__ = ["BoundPlan", "Conditions", "StageEdges", "TooManyStages", "allowed_stages", "Variant", "conditions", "restrict", "coarse_grid", "in_layers", "PlanTuple", "safe_conditions", "without_classes", "dp_work", "feasible", "hop_bytes", "cut_hop_bytes", "hop_classes", "lower_bound", "plan_at", "proof_conditions", "proof_sets", "prove", "tighten",
           "replica_choices", "tighten_step_work", "transfer_ms"]

