"""The CP-SAT model: stage boundaries, replicas, placement and a lower bound of the simulated
iteration time that is exact on the paths that decide most pipelines' makespan.

Internal module. Slots are numbered from the *end* of the pipeline (slot 0 = last stage), so
the replicas "from here to the end" that fix a stage's 1F1B warm-up and in-flight activations
(`w_j = ceil(min(m, U_j) / r_j)`, `U_j = r_0 + ... + r_j`) are a prefix sum; the stage count
is the number of active slots. Placement: per stage, how many devices of each node class it
takes and whether it sits on one node; per pair of neighbours, whether they share one node
(then their link is intra-node). For each slot `j` with per-microbatch times `f_j`, `b_j`,
link time `c_j` to the next stage (the tensors of the boundary layer into the next, a lower
bound of the real traffic on a DAG), all-reduce `AR_j` and `m_j = ceil(m / r_j)` microbatches
on replica 0, longest paths of the simulator's dependency graph are priced; each is a lower
bound of the simulated time, which is all the verified search in `search.py` needs:

- `A_j` the first forward's arrival, `Q_j` the longest way from the stage's last backward to
  the end (backwards up the pipeline, or an all-reduce), `R_j` the first microbatch's round
  trip from this stage to the end and back;
- `P1_j = A_j + m_j (f_j + b_j) + Q_j` (the stage busy all the time);
- `P2_j = A_j + R_j + (m_j - w_j)(f_j + b_j) + (w_j - 1) b_j + Q_j` (waiting for the first
  backward, then the steady state);
- `P4_j = A_j + 2 R_j + (m_j - w_j - 1)(f_j + b_j) + Q_j` when `w_j < m_j` (first and last
  microbatch round trips);
- the same for the last replica of a replicated stage, whose first microbatch leaves the
  previous stage after `floor(q / r_prev)` of that stage's forwards;
- GPipe: `P1_j` and `A_j + R_j + (m_j - 1) b_j + Q_j`, `A_j + R_j + (m_j - 1) f_j + Q_j`.

Products with `w_j` are linearised over its values (one Boolean per value); replica counts
are grouped into buckets over which `ceil(m / r)` is constant (exact up to 16 replicas).
With objective `throughput` the model minimises PipeDream's slowest stage instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from planner.cpsat.instance import MEMORY_UNIT_BYTES, Instance, replica_buckets


@dataclass
class Handles:
    """The variables a solution is read from (and a hint written to)."""

    model: cp_model.CpModel
    slots: int
    buckets: list[tuple[int, int]]
    e: list[cp_model.IntVar]  # e[j] = first layer of slot j (its stop is e[j-1], L for j = 0)
    act: list[cp_model.IntVar]
    r: list[cp_model.IntVar]
    opt: list[list[cp_model.IntVar]]  # [slot][placement]
    y: list[list[cp_model.IntVar]]  # [slot][class] devices
    same: list[cp_model.IntVar | None]  # same[j]: slot j and j-1 share one node (j >= 1)
    q: list[list[cp_model.IntVar]]  # [slot][bucket]
    T: cp_model.IntVar
    extra: dict[str, list] = field(default_factory=dict)


def _bool_sum_eq(model: cp_model.CpModel, lits: list, target) -> None:
    model.Add(sum(lits) == target)


def build_model(inst: Instance, max_stages: int, lower_bound_units: int = 0,
                exact: bool = True) -> Handles:
    """`exact`: price in-flight memory and the warm-up exactly (two products per slot);
    without it both are relaxed to linear lower bounds (large instances)."""
    model = cp_model.CpModel()
    L, m, D = inst.num_layers, inst.num_microbatches, inst.num_devices
    J = max(1, min(max_stages, L, D))
    big = inst.upper_units
    buckets = replica_buckets(m, D, inst.powers_of_two)
    P = inst.placements
    C = inst.classes
    r_values = [0] + [r for r in range(1, D + 1) if not inst.powers_of_two or r & (r - 1) == 0]

    e = [model.NewIntVar(0, L - 1, f"e{j}") for j in range(J)]
    act = [model.NewConstant(1)] + [model.NewBoolVar(f"act{j}") for j in range(1, J)]
    for j in range(1, J):
        model.Add(e[j - 1] >= 1).OnlyEnforceIf(act[j])
        model.Add(e[j] <= e[j - 1] - 1).OnlyEnforceIf(act[j])
        model.Add(e[j - 1] == 0).OnlyEnforceIf(act[j].Not())
        model.Add(e[j] == 0).OnlyEnforceIf(act[j].Not())
        model.AddImplication(act[j], act[j - 1])
    model.Add(e[J - 1] == 0)

    r = [model.NewIntVarFromDomain(cp_model.Domain.FromValues(r_values), f"r{j}") for j in range(J)]
    opt = [[model.NewBoolVar(f"opt{j}_{p}") for p in range(len(P))] for j in range(J)]
    y = [[model.NewIntVar(0, min(D, k.capacity), f"y{j}_{c}") for c, k in enumerate(C)]
         for j in range(J)]
    q = [[model.NewBoolVar(f"q{j}_{i}") for i in range(len(buckets))] for j in range(J)]
    for j in range(J):
        _bool_sum_eq(model, opt[j], act[j])
        _bool_sum_eq(model, q[j], act[j])
        model.Add(r[j] >= 1).OnlyEnforceIf(act[j])
        model.Add(r[j] == 0).OnlyEnforceIf(act[j].Not())
        model.Add(sum(y[j]) == r[j])
        for i, (lo, hi) in enumerate(buckets):
            model.AddLinearConstraint(r[j], lo, hi).OnlyEnforceIf(q[j][i])
        for p, pl in enumerate(P):
            lit = opt[j][p]
            for c in range(len(C)):
                if pl.local and c == pl.classes[0]:
                    model.Add(y[j][c] == r[j]).OnlyEnforceIf(lit)
                elif c in pl.classes and not pl.local:
                    model.Add(y[j][c] >= 1).OnlyEnforceIf(lit)
                else:
                    model.Add(y[j][c] == 0).OnlyEnforceIf(lit)
            if pl.local:
                model.Add(r[j] <= C[pl.classes[0]].devices_per_node).OnlyEnforceIf(lit)
            else:
                model.Add(r[j] >= 2).OnlyEnforceIf(lit)
    for c, k in enumerate(C):
        model.Add(sum(y[j][c] for j in range(J)) <= k.capacity)
    model.Add(sum(r) <= D)

    loc = [sum(opt[j][p] for p, pl in enumerate(P) if pl.local) for j in range(J)]
    locc = [[sum(opt[j][p] for p, pl in enumerate(P) if pl.local and pl.classes[0] == c)
             for c in range(len(C))] for j in range(J)]
    same: list[cp_model.IntVar | None] = [None]
    for j in range(1, J):
        s = model.NewBoolVar(f"same{j}")
        same.append(s)
        model.Add(loc[j] == 1).OnlyEnforceIf(s)
        for c in range(len(C)):
            model.Add(locc[j][c] == locc[j - 1][c]).OnlyEnforceIf(s)
    # a run of stages sharing one node must fit on it
    gl = [model.NewIntVar(0, D, f"gl{j}") for j in range(J)]
    for j in range(J):
        model.Add(gl[j] >= r[j])
        if j + 1 < J:
            model.Add(gl[j] >= r[j] + gl[j + 1]).OnlyEnforceIf(same[j + 1])
        for c, k in enumerate(C):
            for p, pl in enumerate(P):
                if pl.local and pl.classes[0] == c:
                    model.Add(gl[j] <= k.devices_per_node).OnlyEnforceIf(opt[j][p])

    # ---- per-boundary table lookups: boundary j is e[j]; boundary -1 is L
    def lookup(table: tuple[int, ...], name: str) -> list:
        out = []
        lo, hi = min(table), max(table)
        for j in range(J):
            v = model.NewIntVar(lo, hi, f"{name}{j}")
            model.AddElement(e[j], list(table[:L]), v)
            out.append(v)
        return out

    def stage_diff(vals: list, full: int, j: int):
        return (full if j == 0 else vals[j - 1]) - vals[j]

    speeds = inst.speeds
    f = [model.NewIntVar(0, big, f"f{j}") for j in range(J)]
    b = [model.NewIntVar(0, big, f"b{j}") for j in range(J)]
    for v in speeds:
        EF = lookup(inst.fwd_prefix[v], f"EF{v}_")
        EB = lookup(inst.bwd_prefix[v], f"EB{v}_")
        for j in range(J):
            lits = [opt[j][p] for p, pl in enumerate(P) if pl.speed == v]
            if not lits:
                continue
            sv = model.NewBoolVar(f"spd{j}_{v}")
            model.Add(sum(lits) == sv)
            model.Add(f[j] >= stage_diff(EF, inst.fwd_prefix[v][L], j)).OnlyEnforceIf(sv)
            model.Add(b[j] >= stage_diff(EB, inst.bwd_prefix[v][L], j)).OnlyEnforceIf(sv)

    # ---- in-flight microbatches of 1F1B's busiest replica: w_j = ceil(min(m, U_j) / r_j) with
    # U_j the replicas from this stage to the end (GPipe: ceil(m / r_j))
    inf = [model.NewIntVar(0, m, f"inf{j}") for j in range(J)]
    for j in range(J):
        model.Add(inf[j] == 0).OnlyEnforceIf(act[j].Not())
        if inst.schedule == "gpipe":
            mu = m
        else:
            mu = model.NewIntVar(0, m, f"mu{j}")
            model.AddMinEquality(mu, [m, sum(r[: j + 1])])
        for i, (lo, hi) in enumerate(buckets):
            model.Add(hi * inf[j] >= mu).OnlyEnforceIf(q[j][i])
            model.Add(lo * inf[j] <= mu + lo - 1).OnlyEnforceIf(q[j][i])
    # its value as booleans (exact mode), so products with it stay linear
    iv: list[list] = []
    if exact:
        for j in range(J):
            lits = [model.NewBoolVar(f"iv{j}_{v}") for v in range(m + 1)]
            model.AddExactlyOne(lits)
            model.Add(inf[j] == sum(v * lit for v, lit in enumerate(lits)))
            iv.append(lits)

    # ---- memory per device: static + in-flight activations <= the placement's limit
    ES = lookup(inst.static_prefix_kb, "ES")
    EA = lookup(inst.act_prefix_kb, "EA")
    for j in range(J):
        static = stage_diff(ES, inst.static_prefix_kb[L], j)
        acts = model.NewIntVar(0, inst.act_prefix_kb[L], f"acts{j}")
        model.Add(acts == stage_diff(EA, inst.act_prefix_kb[L], j))
        held = model.NewIntVar(0, inst.act_prefix_kb[L] * m, f"held{j}")
        if exact:
            for v, lit in enumerate(iv[j]):
                if v:
                    model.Add(held >= v * acts).OnlyEnforceIf(lit)
        else:
            for i, (_lo, hi) in enumerate(buckets):
                low = math.ceil((m if inst.schedule == "gpipe" else min(m, hi + j)) / hi)
                model.Add(held >= low * acts).OnlyEnforceIf(q[j][i])
        limit = sum(opt[j][p] * int(pl.memory_bytes // MEMORY_UNIT_BYTES + 2)
                    for p, pl in enumerate(P))
        model.Add(static + held <= limit)

    # ---- links and all-reduce
    CI = lookup(inst.cut_intra, "CI")
    CX = lookup(inst.cut_inter, "CX")
    c = [model.NewConstant(0)] + [model.NewIntVar(0, big, f"c{j}") for j in range(1, J)]
    for j in range(1, J):
        model.Add(c[j] >= CX[j - 1]).OnlyEnforceIf(same[j].Not())
        model.Add(c[j] >= CI[j - 1]).OnlyEnforceIf(same[j])
    if exact and inst.pair_intra is not None and inst.pair_inter is not None:
        # on a DAG: every tensor of the stage that layer e[j-1] uses crosses this boundary
        for j in range(1, J):
            idx = model.NewIntVar(0, (L + 1) * (L + 1) - 1, f"pair{j}")
            model.Add(idx == e[j] * (L + 1) + e[j - 1])
            for table, lit in ((inst.pair_inter, same[j].Not()), (inst.pair_intra, same[j])):
                v = model.NewIntVar(0, max(table), "")
                model.AddElement(idx, list(table), v)
                model.Add(c[j] >= v).OnlyEnforceIf(lit)
    ARI = lookup(inst.ar_intra_prefix, "ARI")
    ARX = lookup(inst.ar_inter_prefix, "ARX")
    AR = [model.NewIntVar(0, big, f"AR{j}") for j in range(J)]
    locb = []
    for j in range(J):
        lb = model.NewBoolVar(f"loc{j}")
        model.Add(loc[j] == lb)
        locb.append(lb)
        pi = stage_diff(ARI, inst.ar_intra_prefix[L], j)
        px = stage_diff(ARX, inst.ar_inter_prefix[L], j)
        for i, (lo, _hi) in enumerate(buckets):
            if lo == 1:
                continue
            lat = 2 * inst.latency_units * (r[j] - 1)
            model.Add(lo * AR[j] >= 2 * (lo - 1) * pi + lo * lat).OnlyEnforceIf([q[j][i], lb])
            model.Add(lo * AR[j] >= 2 * (lo - 1) * px + lo * lat).OnlyEnforceIf(
                [q[j][i], lb.Not()])

    # ---- the objective
    T = model.NewIntVar(0, big, "T")
    if inst.objective == "throughput":
        # PipeDream's steady state: the slowest stage per microbatch, counting compute over
        # replicas plus the all-reduce amortised over the microbatches, and each boundary's
        # two transfers over the receiving stage's replicas
        for j in range(J):
            for i, (_lo, hi) in enumerate(buckets):
                # (f + b) / r + AR / m <= T
                model.Add(m * hi * T >= m * (f[j] + b[j]) + hi * AR[j]).OnlyEnforceIf(q[j][i])
                if j >= 1:
                    model.Add(hi * T >= 2 * c[j]).OnlyEnforceIf(q[j - 1][i])
        model.Minimize(T)
        return Handles(model, J, buckets, e, act, r, opt, y, same, q, T,
                       {"f": f, "b": b, "c": c, "AR": AR})

    A = [model.NewIntVar(0, big, f"A{j}") for j in range(J)]
    Q = [model.NewIntVar(0, big, f"Q{j}") for j in range(J)]
    R = [model.NewIntVar(0, big, f"R{j}") for j in range(J)]
    W1 = [model.NewIntVar(0, big, f"W1_{j}") for j in range(J)]
    W2 = [model.NewIntVar(0, big, f"W2_{j}") for j in range(J)]
    W3 = [model.NewIntVar(0, big, f"W3_{j}") for j in range(J)]
    wf = None
    if exact and inst.schedule != "gpipe":
        wf = [model.NewIntVar(0, big, f"wf{j}") for j in range(J)]
        for j in range(J):
            for v, lit in enumerate(iv[j]):
                model.Add(wf[j] <= v * f[j]).OnlyEnforceIf(lit)
    for j in range(J):
        if j == J - 1:
            model.Add(A[j] == 0)
        else:
            model.Add(A[j] == A[j + 1] + f[j + 1] + c[j + 1])
            model.Add(Q[j] >= c[j + 1] + b[j + 1] + Q[j + 1])
        model.Add(Q[j] >= AR[j])
        if j == 0:
            model.Add(R[j] == f[j] + b[j])
        else:
            model.Add(R[j] == f[j] + b[j] + 2 * c[j] + R[j - 1])
        for i, (_lo, hi) in enumerate(buckets):
            mk = math.ceil(m / hi)
            model.Add(W1[j] >= mk * (f[j] + b[j])).OnlyEnforceIf(q[j][i])
            if inst.schedule == "gpipe":
                model.Add(W2[j] >= (mk - 1) * b[j]).OnlyEnforceIf(q[j][i])
                model.Add(W3[j] >= (mk - 1) * f[j]).OnlyEnforceIf(q[j][i])
            elif wf is not None:
                # (m_j - w)(f + b) + (w - 1) b = m_j (f + b) - w f - b
                model.Add(W2[j] >= mk * (f[j] + b[j]) - wf[j] - b[j]).OnlyEnforceIf(q[j][i])
            else:
                model.Add(W2[j] >= (mk - 1) * b[j]).OnlyEnforceIf(q[j][i])
        model.Add(T >= A[j] + W1[j] + Q[j])
        model.Add(T >= A[j] + R[j] + W2[j] + Q[j])
        model.Add(T >= A[j] + R[j] + W3[j] + Q[j])
        if wf is not None:
            # the first microbatch's round trip, the steady state up to the last forward, and
            # the last microbatch's round trip (only when the warm-up does not hold them all)
            for i, (lo, hi) in enumerate(buckets):
                if lo != hi:
                    continue
                mk = math.ceil(m / lo)
                for v in range(1, mk):
                    model.Add(T >= A[j] + 2 * R[j] + (mk - v - 1) * (f[j] + b[j]) + Q[j]
                              ).OnlyEnforceIf([q[j][i], iv[j][v]])
        if exact and j + 1 < J:
            # the last replica q of a replicated stage starts later: microbatch q leaves the
            # previous stage's replica after floor(q / r_prev) forwards of that replica
            dl = model.NewIntVar(0, big, f"dl{j}")
            W4 = model.NewIntVar(0, big, f"W4_{j}")
            W5 = model.NewIntVar(0, big, f"W5_{j}")
            for i, (lo, hi) in enumerate(buckets):
                if lo != hi or lo == 1:
                    continue
                qr = min(lo, m) - 1
                mq = len(range(qr, m, lo))
                model.Add(W4 >= mq * (f[j] + b[j])).OnlyEnforceIf(q[j][i])
                if wf is not None:
                    model.Add(W5 >= mq * (f[j] + b[j]) - wf[j] - b[j]).OnlyEnforceIf(q[j][i])
                for i2, (lo2, hi2) in enumerate(buckets):
                    if lo2 == hi2 and qr // lo2 > 0:
                        model.Add(dl >= (qr // lo2) * f[j + 1]).OnlyEnforceIf([q[j][i], q[j + 1][i2]])
            model.Add(T >= A[j] + dl + W4 + Q[j])
            model.Add(T >= A[j] + dl + R[j] + W5 + Q[j])
    model.Add(T >= lower_bound_units)
    model.Minimize(T)
    model.AddDecisionStrategy(e + r + [v for row in opt for v in row] + same[1:],
                              cp_model.CHOOSE_FIRST, cp_model.SELECT_MIN_VALUE)
    return Handles(model, J, buckets, e, act, r, opt, y, same, q, T,
                   {"f": f, "b": b, "c": c, "AR": AR, "A": A, "Q": Q, "R": R})
