"""The plan space the search walks: a structure (microbatch size, stage boundaries, replicas,
placement policy) and its score under the planner's own `evaluate()`.

A structure becomes a `Candidate` by placing its stages on ranks (`place`). Scores compare
lexicographically: a plan that fits memory beats one that does not (those compare by how far
they overshoot); then the simulated iteration time (or PipeDream's slowest stage with
`--objective throughput`), equal to a relative 1e-9; then fewer devices, then fewer stages —
a device that does no work is a device the user pays for.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from planner.build import Evaluation, evaluate
from planner.cost import LayerTable, PipelineCosts
from planner.formats import Cluster, Device, PlanOptions
from planner.partition import Candidate, StageChoice
from planner.schedules import zb_h1_own_peaks
from planner.simulator import SHAPE_ACTIONS

STYLES = ("packed", "aligned")
EVERY_PLACEMENT = 12  # devices up to which every node placement of a structure is scored
PLACEMENTS_PER_STRUCTURE = 64
# The work of one evaluation, in the budget's units (`planner.search.WORK_PER_SECOND`; the
# bound's DP spends about one per cell). Fitted on 2026-12-05 to 139k evaluations of 12
# plan-quality instances, each timed against the DP's units of the same plan (200k per second
# on that machine): 13 us per evaluation, 2.7 us per device and per pair of stages that
# exchange tensors, and per simulated action 1.9 us where this search sees the schedule's
# shape for the first time (`simulator.simulate_generated` simulates it as it comes), 2.9 us
# the second time (the shape is made) and 0.2 us after (the kept shape). Until then every
# evaluation was charged 0.6 x (its actions + ...) units, as a first sighting of 4.3 us per
# action: 2.2-8.5x its time on those instances, so the search got a fraction of the
# evaluations its share of the wall clock affords (a 200-layer chain on 4 x 4 devices, 64
# microbatches: 122.1 ms, where a climb from that plan reaches 104.5 ms in 1,800 evaluations).
EVAL_FIXED = 2.6
EVAL_PER_SLOT = 0.54
EVAL_PER_ACTION = (0.37, 0.57, 0.04)  # the shape's first sighting in this search, its second, later
# evaluations are charged EVAL_PRICE x their time: the search's share of the wall clock
# against the bound's (1: as their time)
EVAL_PRICE = 2.0
TIME_TOL = 1e-9  # relative: two times this close are equal (prefer fewer devices, stages)


@dataclass(frozen=True, order=True)
class Structure:
    microbatch_size: int
    bounds: tuple[int, ...]  # [0, stop_0, ..., L]
    replicas: tuple[int, ...]
    policy: int = 0  # index into `placement_policies(cluster)`
    tp: tuple[int, ...] = ()  # tensor-parallel degree per stage; () = 1 everywhere

    @property
    def num_stages(self) -> int:
        return len(self.replicas)

    @property
    def degrees(self) -> tuple[int, ...]:
        return self.tp or (1,) * len(self.replicas)

    @property
    def num_devices(self) -> int:
        if not self.tp:
            return sum(self.replicas)
        return sum(r * t for r, t in zip(self.replicas, self.tp, strict=True))

    def with_stages(self, bounds, replicas, tp=None, policy: int | None = None) -> Structure:
        """A structure like this one with other stages (degrees all 1 are stored as ())."""
        tp = tuple(tp) if tp is not None else (self.tp if len(replicas) == len(self.replicas) else ())
        return Structure(self.microbatch_size, tuple(bounds), tuple(replicas),
                         self.policy if policy is None else policy,
                         () if tp.count(1) == len(tp) else tp)


Policy = tuple[tuple[tuple[Device, ...], ...], str]  # nodes in the order stages take them, style


def placement_policies(cluster: Cluster) -> list[Policy]:
    """The orders in which stages take nodes (fastest first, slowest first, most memory
    first, least memory first; distinct ones only), each packed or aligned."""
    nodes: dict[int, list[Device]] = {}
    for d in cluster.devices():
        nodes.setdefault(d.node, []).append(d)
    keys = [lambda n: (-nodes[n][0].speed, n), lambda n: (nodes[n][0].speed, n),
            lambda n: (-nodes[n][0].memory_bytes, n), lambda n: (nodes[n][0].memory_bytes, n)]
    orders: list[tuple[tuple[Device, ...], ...]] = []
    for key in keys:
        order = tuple(tuple(nodes[n]) for n in sorted(nodes, key=key))
        if order not in orders:
            orders.append(order)
    styles = STYLES if len(nodes) > 1 else STYLES[:1]
    return [(o, style) for o in orders for style in styles]


def place(st: Structure, policy: Policy) -> tuple[tuple[int, ...], ...] | None:
    """Ranks of every stage (replica-major, each replica's `tp` ranks on one node), or None if
    the policy cannot place the structure.

    packed: consecutive devices, node after node in the policy's order;
    aligned: like packed, but a stage that would straddle two nodes and fits in one starts on
    the next node when enough devices are left for the stages after it."""
    nodes, style = policy
    free = [list(n) for n in nodes]
    per_node = [len(n) for n in nodes]
    remaining = st.num_devices
    out: list[tuple[int, ...]] = []
    k = 0  # current node
    for r, t in zip(st.replicas, st.degrees, strict=True):
        while k < len(free) and not free[k]:
            k += 1
        if k >= len(free):
            return None
        if style == "aligned" and r * t <= max(per_node):
            left_here = len(free[k])
            spare = sum(len(f) for f in free) - remaining
            if r * t > left_here and spare >= left_here and k + 1 < len(free):
                k += 1
        ranks: list[int] = []
        for _ in range(r):
            # a TP group stays inside one node: the first node from k on with t free devices
            # (devices a TP group left on a node remain for later stages of smaller degree)
            n = next((n for n in range(k, len(free)) if len(free[n]) >= t), None)
            if n is None:
                return None
            ranks += [free[n].pop(0).rank for _ in range(t)]
            while k < len(free) and not free[k]:
                k += 1
        remaining -= r * t
        out.append(tuple(ranks))
    return tuple(out)


def to_candidate(st: Structure, policies: list[Policy], num_microbatches: int
                 ) -> Candidate | None:
    """`policies`: `placement_policies(cluster)`."""
    if st.policy >= len(policies):
        return None
    devs = place(st, policies[st.policy])
    if devs is None:
        return None
    return candidate_of(st, devs, num_microbatches)


def _recomputed(cand: Candidate, stages: set[int] | frozenset[int]) -> Candidate:
    """`cand` with these stages recomputed as well."""
    return Candidate(tuple(replace(x, recompute=x.recompute or s in stages) for s, x in enumerate(cand.stages)),
                     cand.microbatch_size, cand.num_microbatches)


def candidate_of(st: Structure, devs: tuple[tuple[int, ...], ...], num_microbatches: int
                 ) -> Candidate:
    stages = tuple(StageChoice(a, z, d, False, t) for a, z, d, t in
                   zip(st.bounds, st.bounds[1:], devs, st.degrees, strict=False))
    return Candidate(stages, st.microbatch_size, num_microbatches)


def structure_of(c: Candidate) -> Structure:
    """The structure of a candidate placed by someone else (policy 0)."""
    bounds, reps = (0, *(s.stop for s in c.stages)), tuple(s.replicas for s in c.stages)
    return Structure(c.microbatch_size, bounds, reps, 0).with_stages(
        bounds, reps, tuple(s.tp for s in c.stages))


def idle_ends(table: LayerTable) -> list[int] | None:
    """end[a]: the last z such that the stage [a, z) computes nothing (`compute_ms(a, z) <=
    0`; a itself where layer a computes), so a stage [a, z) is idle exactly when z <= end[a];
    None where the whole model computes nothing (no stage counts as idle then). Per-layer
    times are non-negative, so the prefix sums never decrease and compute_ms(a, z) is 0 exactly
    where both prefixes stay equal from a to z: the search asks this of every move it looks at
    (hundreds of thousands per plan on 128 devices), an integer comparison per stage instead
    of two prefix differences."""
    L = table.num_layers
    if table.compute_ms(0, L) <= 0:
        return None
    end = list(range(L + 1))
    for a in range(L - 1, -1, -1):
        if table.compute_ms(a, a + 1) <= 0:
            end[a] = end[a + 1]
    return end


def throughput_objective_ms(costs: PipelineCosts) -> float:
    """PipeDream's objective of a costed candidate, per iteration: m microbatches through its
    slowest stage in the steady state (a stage's all-reduce and optimizer step shared out over
    them). Per iteration, not per microbatch, so plans of different microbatch sizes compare
    by what they take for the same global batch (per microbatch, `--microbatch-sizes 2,8`
    always took 2: up to 41 % fewer samples per second where per-message latency counts)."""
    m = costs.num_microbatches
    worst = 0.0
    opt = costs.optimizer_ms or (0.0,) * len(costs.stage_devices)
    for s, devs in enumerate(costs.stage_devices):
        r = len(devs)
        worst = max(worst, (costs.fwd_ms[s] + costs.bwd_ms[s]) / r + (costs.allreduce_ms[s] + opt[s]) / m)
        if s >= 1:
            worst = max(worst, 2 * costs.sends[(s - 1, s)].ms / r)
    return m * worst


@dataclass(frozen=True)
class Score:
    # 0 when the plan fits memory, else the sum over stages of need / limit - 1 where above
    # (a sum, not the largest: fixing one of several overflowing stages is progress)
    overshoot: float
    objective_ms: float
    devices: int
    stages: int
    worst: float = 0.0  # the largest need / limit ratio (for messages)

    def better_than(self, other: Score | None) -> bool:
        if other is None:
            return True
        if self.overshoot != other.overshoot:
            return self.overshoot < other.overshoot
        a, b = self.objective_ms, other.objective_ms
        if abs(a - b) > TIME_TOL * max(a, b):
            return a < b
        return (self.devices, self.stages) < (other.devices, other.stages)

    @property
    def fits(self) -> bool:
        return self.overshoot == 0.0


INFEASIBLE = Score(float("inf"), float("inf"), 0, 0, float("inf"))


def tp_degrees(table: LayerTable, cluster: Cluster, options: PlanOptions) -> tuple[int, ...]:
    """The tensor-parallel degrees the search may give a stage: 1 and every profiled degree
    that fits in a node, up to `--max-tp` (default: all of those)."""
    per_node = max(s.devices for s in cluster.node_specs())
    cap = options.max_tp if options.max_tp is not None else per_node
    return (1, *sorted(x.degree for x in table.tp if x.degree <= min(cap, per_node)))


class Evaluator:
    """`evaluate()` with a cache and a count of the work done (simulated actions), which is
    the search's deterministic budget."""

    def __init__(self, table: LayerTable, cluster: Cluster, options: PlanOptions,
                 sizes: list[int] | None = None) -> None:
        if options.schedule == "auto":
            raise ValueError("the search scores one schedule; solve_detailed resolves auto")
        self.table, self.cluster, self.options = table, cluster, options
        self.devices = cluster.devices()
        self.policies = placement_policies(cluster)
        self.degrees = tp_degrees(table, cluster, options)
        # small clusters of several nodes: a structure is scored at its best placement of all
        self.every_placement = len(self.policies) > 1 and cluster.num_devices <= EVERY_PLACEMENT
        self.cache: dict[Structure, tuple[Score, Candidate | None]] = {}
        self.work = 0  # charged for the evaluations (`_count`)
        self.work_limit = 2**62  # set by the search: placement passes stop here
        self.evaluations = 0
        self._sightings: dict[tuple, int] = {}  # schedule shape -> evaluations of it (`_count`)
        self.optima: dict[Structure, Score] = {}  # where descents ended, fitting (`local.descend`)
        self.sizes = sizes or []  # the microbatch sizes the search may move between
        self.cache_extra: dict[object, object] = {}  # what move generators derive from the table
        self.stage_costs: dict = {}  # `pipeline_costs`' per-stage numbers, for this table and cluster
        self._idle_end = idle_ends(table)
        # the layers holding each parameter several layers share (a tied embedding and head):
        # one tied across stages cannot be on a tensor-parallel stage (the runtime refuses it)
        self._tied = [sorted({t.first, *t.others}) for t in table.shared if t.kind != "buffer"] \
            if len(self.degrees) > 1 else []
        # False: a stage that computes nothing is no plan (the search's space and the bound's);
        # True only where no plan without one fits memory (`planner.search._idle_rescue`)
        self.allow_idle = False

    def __call__(self, st: Structure) -> Score:
        return self.scored(st)[0]

    def allowed(self, st: Structure) -> bool:
        """No stage that computes nothing (0 ms: its devices would do no work); replica counts
        that are powers of two with `powers_of_two`; TP degrees the search may use."""
        if self.options.powers_of_two and any(r & (r - 1) for r in st.replicas):
            return False
        if st.num_devices > len(self.devices):
            return False
        if st.tp and any(t not in self.degrees for t in st.tp):
            return False
        if st.tp and self._tied and self._ties_a_tp_stage(st):
            return False
        return not self.idle_stage(st.bounds)

    def _ties_a_tp_stage(self, st: Structure) -> bool:
        """A parameter shared by layers of several stages, one of them tensor-parallel."""
        import bisect

        degrees = st.degrees
        for layers in self._tied:
            stages = {bisect.bisect_right(st.bounds, i) - 1 for i in layers}
            if len(stages) > 1 and any(degrees[k] > 1 for k in stages):
                return True
        return False

    def has_idle_layers(self) -> bool:
        """Some layer computes nothing (so some stage can)."""
        end = self._idle_end
        return end is not None and any(e > a for a, e in enumerate(end[:-1]))

    @contextmanager
    def idle_allowed(self) -> Iterator[None]:
        """Stages that compute nothing allowed inside (`exhaust` where the bound covers them),
        as before after: the structures with one leave the cache on the way in and out (they
        were scored as no plan, and are again)."""
        before = self.allow_idle

        def purge() -> None:
            for st in [st for st in self.cache if self.computes_nothing(st.bounds)]:
                del self.cache[st]

        purge()
        self.allow_idle = True
        try:
            yield
        finally:
            self.allow_idle = before
            purge()

    def idle_stage(self, bounds: tuple[int, ...]) -> bool:
        """True if a stage computes nothing (0 ms) and such stages are not allowed."""
        return not self.allow_idle and self.computes_nothing(bounds)

    def computes_nothing(self, bounds: tuple[int, ...]) -> bool:
        """True if a stage computes nothing (0 ms): it would hold devices that do no work."""
        end = self._idle_end
        if end is None:
            return False
        return any(z <= end[a] for a, z in zip(bounds, bounds[1:], strict=False))

    def _best_placement(self, st: Structure, m: int) -> tuple[Score, Candidate | None]:
        if st.policy != 0 or not self.allowed(st):
            return INFEASIBLE, None
        best: tuple[Score, Candidate | None] = (INFEASIBLE, None)
        for devs in node_placements(st.replicas, self.cluster, PLACEMENTS_PER_STRUCTURE, st.degrees):
            s, cand = self.evaluate_placed(candidate_of(st, devs, m), st)
            if s.better_than(best[0]):
                best = (s, cand)
        return best

    def score_candidate(self, cand: Candidate, st: Structure | None = None
                        ) -> tuple[Score, Candidate]:
        """A candidate placed by someone else (a baseline), scored the same way; with the
        recomputation `evaluate_placed` gives it."""
        st = st or structure_of(cand)
        if not self.allowed(st):
            return INFEASIBLE, cand
        return self.evaluate_placed(cand, st)

    def evaluate_placed(self, cand: Candidate, st: Structure) -> tuple[Score, Candidate]:
        """The candidate's score; where it does not fit memory and recomputation is allowed,
        the same candidate with recomputation on exactly the stages that overflow, if that
        scores better. Under 1F1B and GPipe that is the best choice of recomputation for these
        stages and devices: recomputing adds time and never makes the simulated iteration
        shorter, and a stage's memory does not depend on whether another stage recomputes.
        Under ZB-H1 it does (`_zb_h1_recompute`)."""
        ev = self._evaluate(cand)
        score = self._score(ev, st.num_devices, st.num_stages)
        if score.fits or not self.options.allow_recompute:
            return score, cand
        over = self._overflowing(cand, ev)
        if not over:
            return score, cand
        if self.options.schedule == "zb-h1":
            return self._zb_h1_recompute(cand, st, ev, score)
        rc = _recomputed(cand, over)
        score2 = self._score(self._evaluate(rc), st.num_devices, st.num_stages)
        return (score2, rc) if score2.better_than(score) else (score, cand)

    def _evaluate(self, cand: Candidate) -> Evaluation:
        ev = evaluate(self.table, self.cluster, cand, self.options, self.devices, record=False,
                      stage_cache=self.stage_costs)
        self._count(ev)
        return ev

    @staticmethod
    def _overflowing(cand: Candidate, ev: Evaluation) -> set[int]:
        """The stages that could recompute (TP degree 1, not yet) and need more memory than
        their limit."""
        return {s for s, (need, lim) in enumerate(zip(ev.stage_memory_bytes, ev.costs.memory_limit_bytes,
                                                      strict=True))
                if need > lim and cand.stages[s].tp == 1 and not cand.stages[s].recompute}

    def _zb_h1_recompute(self, cand: Candidate, st: Structure, ev: Evaluation, score: Score
                         ) -> tuple[Score, Candidate]:
        """The best recomputation under ZB-H1, whose stages defer only the W's that keep their
        peak within the largest 1F1B peak of any stage and their own memory limit
        (`schedules.zb_h1_memory_deferrals`):
        a stage may overflow because another's 1F1B peak lets it defer too much, and then
        recomputing that other stage makes it fit (random instances of 6 layers on 3 devices:
        every overflowing stage recomputed, 81.2 ms; the one that sets the cap, 56.4). The
        stages whose own peaks are above their limit (`schedules.zb_h1_own_peaks`) must
        recompute, and once they have, the others fit: that set, and where some stage still
        overflows, that set with it."""
        own = zb_h1_own_peaks(ev.costs)
        limits = ev.costs.memory_limit_bytes
        forced = {s for s, x in enumerate(cand.stages)
                  if x.tp == 1 and not x.recompute and own[s] > limits[s]}
        rc = _recomputed(cand, forced or self._overflowing(cand, ev))
        got = self._evaluate(rc)
        got_s = self._score(got, st.num_devices, st.num_stages)
        still = self._overflowing(rc, got)
        if still:  # (a TP stage's cap, which no recomputation lowers)
            more = _recomputed(rc, still)
            more_s = self._score(self._evaluate(more), st.num_devices, st.num_stages)
            if more_s.better_than(got_s):
                rc, got_s = more, more_s
        return (got_s, rc) if got_s.better_than(score) else (score, cand)

    def idle_split(self, cand: Candidate, score: Score) -> tuple[Score, Candidate]:
        """`cand` with a run of layers that compute nothing at the start or the end of one of
        its stages split off as a stage of its own on one more device (every such split,
        each placed every way the evaluator places a structure), where that is faster. Such
        a stage holds memory (parameters, saved tensors) the others then do not, and the
        search leaves 0-ms stages out: on a mixed cluster of three nodes, ZB-H1 gave one stage
        of 4 layers on 2 devices at 7.51 ms where the 0-ms half on a device of its own runs
        6.53 (an outside exhaustive check). Deterministic: stages and cuts in order."""
        if not self.has_idle_layers():
            return score, cand
        st = structure_of(cand)
        b, r, t = list(st.bounds), list(st.replicas), list(st.degrees)
        tries = []
        for k in range(st.num_stages):
            a, z = b[k], b[k + 1]
            tail = next((c for c in range(a + 1, z) if self.computes_nothing((c, z))), None)
            head = next((c for c in range(z - 1, a, -1) if self.computes_nothing((a, c))), None)
            for c, idle_first in ((tail, False), (head, True)):
                if c is None:
                    continue
                reps = r[:k] + ([1, r[k]] if idle_first else [r[k], 1]) + r[k + 1:]
                tps = t[:k] + ([1, t[k]] if idle_first else [t[k], 1]) + t[k + 1:]
                tries.append(st.with_stages(b[:k + 1] + [c] + b[k + 1:], reps, tps))
        best = (score, cand)
        with self.idle_allowed():
            for x in tries:
                got, placed = self.scored(x)
                if placed is not None and got.fits and got.better_than(best[0]):
                    best = (got, placed)
        return best

    def zb_h1_recompute_toggled(self, cand: Candidate, score: Score) -> tuple[Score, Candidate]:
        """Under ZB-H1, `cand` with each stage's recomputation turned on or off, one stage at a
        time, kept where it scores better, until none does (at most one pass per stage). The
        search recomputes only where a plan does not fit (`evaluate_placed`), but under ZB-H1
        a stage that fits can gain by recomputing: with less memory held it defers more W's
        (an 8-layer chain on 5 devices: a last stage of 0 ms at 170.8 of 171.5 MB, recomputed,
        40.34 -> 37.78 ms). Deterministic: stages in order."""
        if self.options.schedule != "zb-h1" or not self.options.allow_recompute:
            return score, cand
        st = structure_of(cand)
        for _ in range(len(cand.stages)):
            better = None
            for s, x in enumerate(cand.stages):
                if x.tp != 1:
                    continue
                flip = Candidate(tuple(replace(y, recompute=not y.recompute) if k == s else y
                                       for k, y in enumerate(cand.stages)),
                                 cand.microbatch_size, cand.num_microbatches)
                got = self._score(self._evaluate(flip), st.num_devices, st.num_stages)
                if got.better_than(score if better is None else better[0]):
                    better = (got, flip)
            if better is None:
                break
            score, cand = better
        return score, cand

    def simulation_work(self, num_microbatches: int, stages: int, devices: int) -> int:
        """The most work of one evaluation (its schedule's shape not seen before): simulated
        actions (F and B per microbatch and stage; ZB-H1: F, B and W, and the search for each
        stage's W deferral, about as much again), and a part per device and pair of stages."""
        return self._price(num_microbatches, stages, devices, stages, 0)

    def _price(self, num_microbatches: int, stages: int, devices: int, pairs: int, seen: int) -> int:
        per_mb = 5 if self.options.schedule == "zb-h1" else 2
        actions = per_mb * num_microbatches * stages
        return int(EVAL_PRICE * (EVAL_FIXED + EVAL_PER_SLOT * (devices + pairs)
                                 + EVAL_PER_ACTION[min(seen, 2)] * actions))

    def _count(self, ev: Evaluation) -> None:
        """Charge one evaluation (`EVAL_FIXED` ...): its schedule's shape as this search has
        seen it (`simulator.simulate_generated` keeps shapes process-wide, but the charge must
        not depend on what the process planned before)."""
        c = ev.costs
        key = (tuple(len(d) for d in c.stage_devices), c.num_microbatches, tuple(c.sends), ev.deferred)
        seen = self._sightings.get(key, 0)
        self._sightings[key] = seen + 1
        devices = sum(len(d) for d in c.stage_devices)
        kinds = 3 if self.options.schedule == "zb-h1" else 2  # F, B (and W) per microbatch and stage
        if kinds * c.num_microbatches * len(c.stage_devices) > SHAPE_ACTIONS:
            seen = 0  # too large to keep: simulated as it comes every time
        self.work += self._price(c.num_microbatches, len(c.stage_devices), devices, len(c.sends), seen)
        self.evaluations += 1

    def _score(self, ev: Evaluation, devices: int, stages: int) -> Score:
        obj = ev.iteration_ms if self.options.objective == "iteration" \
            else throughput_objective_ms(ev.costs)
        if ev.fits:
            return Score(0.0, obj, devices, stages, ev.memory_overshoot())
        excess = sum(max(0.0, need / lim - 1) for need, lim in
                     zip(ev.stage_memory_bytes, ev.costs.memory_limit_bytes, strict=True))
        return Score(excess, obj, devices, stages, ev.memory_overshoot())

    def scored(self, st: Structure) -> tuple[Score, Candidate | None]:
        hit = self.cache.get(st)
        if hit is not None:
            return hit
        m = self.options.global_batch // st.microbatch_size
        if self.every_placement:
            out = self._best_placement(st, m)
            self.cache[st] = out
            return out
        cand = to_candidate(st, self.policies, m) if self.allowed(st) else None
        out: tuple[Score, Candidate | None] = \
            (INFEASIBLE, None) if cand is None else self.evaluate_placed(cand, st)
        self.cache[st] = out
        return out


def node_placements(replicas: tuple[int, ...], cluster: Cluster, limit: int,
                    degrees: tuple[int, ...] | None = None, canonical: bool = False
                    ) -> Generator[tuple[tuple[int, ...], ...], None, int]:
    """Every way to take each stage's replicas from the nodes (a device count per node per
    stage, a multiple of the stage's TP degree: a TP group stays in one node; which devices of
    a node does not matter), up to `limit` of them, in a fixed order; returns how many it
    enumerated (duplicates included). Placements that give every stage the same set of nodes
    as one already yielded are skipped (the cost model sees only those sets). With
    `canonical`, orders of nodes of one class that no stage used before are not enumerated
    (they only repeat a placement: every key is still reached, fewer duplicates)."""
    devs = cluster.devices()
    per_node: dict[int, list[int]] = {}
    for d in devs:
        per_node.setdefault(d.node, []).append(d.rank)
    nodes = sorted(per_node)
    specs = cluster.node_specs()
    classes: dict[tuple, int] = {}
    node_class = [classes.setdefault((specs[n].devices, specs[n].speed, specs[n].device_memory_gb),
                                     len(classes)) for n in nodes]
    seen: set[tuple] = set()
    count = 0

    degrees = degrees or (1,) * len(replicas)

    full = [len(per_node[n]) for n in nodes]

    def vectors(r: int, free: list[int], k: int, t: int, room: list[int] | None = None,
                caps: dict[int, int] | None = None):
        """Device counts per node from node k on: r replicas of t devices each (`room[k]`:
        the groups of t that nodes k.. can still take; no branch that cannot place them all).
        With `canonical`, nodes no stage has used yet are interchangeable within their class:
        their counts do not increase from one to the next (`caps`: the last of each class)."""
        if room is None:
            room = [0] * (len(free) + 1)
            for n in range(len(free) - 1, -1, -1):
                room[n] = room[n + 1] + free[n] // t
        if r > room[k]:
            return
        if k == len(free):
            yield ()
            return
        top = min(r, free[k] // t)
        fresh = canonical and free[k] == full[k]
        if fresh and caps is not None and node_class[k] in caps:
            top = min(top, caps[node_class[k]])
        for v in range(top, -1, -1):
            nxt = {**(caps or {}), node_class[k]: v} if fresh else caps
            for rest in vectors(r - v, free, k + 1, t, room, nxt):
                yield (v * t, *rest)

    def rec(s: int, free: list[int], acc: list[tuple[int, ...]]):
        nonlocal count
        if count >= limit:
            return
        if s == len(replicas):
            count += 1  # duplicates count too: the limit bounds the work, not the yield
            # nodes of one class are interchangeable: name them in order of first use
            names: dict[int, tuple[int, int]] = {}
            per_class: dict[int, int] = {}
            key_parts = []
            for vec in acc:
                part = []
                for k, v in enumerate(vec):
                    if v:
                        if k not in names:
                            c = node_class[k]
                            names[k] = (c, per_class.get(c, 0))
                            per_class[c] = per_class.get(c, 0) + 1
                        part.append((names[k], v))
                key_parts.append(tuple(sorted(part)))
            key = tuple(key_parts)
            if key in seen:
                return
            seen.add(key)
            used = [0] * len(nodes)
            out = []
            for vec in acc:
                ranks: list[int] = []
                for k, v in enumerate(vec):
                    ranks += per_node[nodes[k]][used[k]:used[k] + v]
                    used[k] += v
                out.append(tuple(ranks))
            yield tuple(out)
            return
        for vec in vectors(replicas[s], free, 0, degrees[s]):
            if count >= limit:
                return
            yield from rec(s + 1, [f - v for f, v in zip(free, vec, strict=True)], acc + [vec])

    yield from rec(0, list(full), [])
    return count


def every_node_placement(replicas: tuple[int, ...], cluster: Cluster, limit: int,
                         degrees: tuple[int, ...] | None = None
                         ) -> tuple[list[tuple[tuple[int, ...], ...]] | None, int]:
    """Every distinct node placement (`node_placements`, without the orders of nodes no stage
    had used before, which only repeat one), or None where `limit` cut it short; and the
    placements enumerated, duplicates included."""
    gen = node_placements(replicas, cluster, limit, degrees, canonical=True)
    out = []
    while True:
        try:
            out.append(next(gen))
        except StopIteration as stop:
            count = stop.value
            return (out if count < limit else None), count
