"""Static check that a plan's point-to-point traffic cannot deadlock or mismatch under NCCL.

NCCL matches a pair of ranks' sends and receives by *order*, not by tag, and runs them in the
order they were issued; a rank blocked in a receive whose partner is queued behind another
operation hangs forever (gloo, with tags and a receive thread, does not). So before a plan
runs on NCCL, every pair of ranks must issue their operations in a compatible order. This
module derives, from each rank's actions alone, the operations the runtime issues in its
batched protocol (`runtime.comm.P2P` with `batched=True`, used on NCCL):

    issue   the receives of action 0
    for each action i:
        wait    for the receives of action i
        run     action i
        issue   one batch (`batch_isend_irecv`): the sends of action i + the receives of action i+1
    wait    for every send (the flush); last-stage ranks then send their loss to rank 0,
            which receives them one by one

where `F(s, j)` receives the activations of microbatch j from each producing stage and sends
its outputs to each consuming stage, `B(s, j)` receives the output gradients from the consumers
and sends the input gradients to the producers, and any other action (`W`: weight gradient)
communicates nothing. Microbatch j of stage t lives on replica `j % r_t`. One message stands
for every tensor a stage pair exchanges for one microbatch in one direction (both sides walk
the tensors in the same order). A tensor-parallel stage (degree t, replica k on ranks
`devices[k*t:(k+1)*t]`) runs the same actions on each of its TP ranks: TP rank u receives
from TP rank `u mod t'` of the other stage's replica (degree t') and sends to every rank there
whose `u' mod t` is u, as the runtime does (`runtime.executor`).

Then it simulates the most conservative NCCL model: each rank executes its issued batches in
order, one at a time (one stream); an operation completes when its partner is in the partner
rank's current batch (a rendezvous: nothing is buffered); a batch completes when all its
operations have. A plan passes when every operation completes and each pair's k-th message
is the same on both sides. Pure: plain data in, `P2PError` (a PipeplanError) out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from planner.actions import Action
from planner.errors import PipeplanError


class P2PError(PipeplanError):
    """Two ranks would issue their sends and receives in orders NCCL cannot match."""


@dataclass(frozen=True, order=True)
class Message:
    """One stage pair's tensors of one microbatch in one direction."""

    kind: str  # "act" (forward, src stage -> dst stage) | "grad" (backward) | "loss"
    src_stage: int
    dst_stage: int
    mb: int

    def __str__(self) -> str:
        if self.kind == "loss":
            return f"the loss (stage {self.src_stage} -> rank 0)"
        what = "activations" if self.kind == "act" else "gradients"
        return f"{what} of microbatch {self.mb} from stage {self.src_stage} to stage {self.dst_stage}"


@dataclass(frozen=True)
class Op:
    send: bool
    peer: int
    msg: Message

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.msg} {'to' if self.send else 'from'} rank {self.peer}"


@dataclass(frozen=True)
class Step:
    """`issue` a batch of ops, or `wait` until some of the ops already issued complete."""

    what: str  # "issue" | "wait"
    ops: tuple[Op, ...]
    action: str = ""  # the action it belongs to, for messages


def _replica(stage_devices: Sequence[Sequence[int]], tps: Sequence[int], stage: int, mb: int
             ) -> Sequence[int]:
    devs, t = stage_devices[stage], tps[stage]
    k = mb % (len(devs) // t)
    return devs[k * t:(k + 1) * t]


def action_ops(a: Action, stage_devices: Sequence[Sequence[int]],
               pairs: Iterable[tuple[int, int]], grad_pairs: Iterable[tuple[int, int]] | None = None,
               tps: Sequence[int] | None = None, tp_rank: int = 0) -> tuple[list[Op], list[Op]]:
    """(receives, sends) of one action on TP rank `tp_rank` of its replica. `pairs`: stage
    pairs (s, t) whose tensors flow forward; `grad_pairs`: those whose gradients flow back
    (default: all of them); `tps`: each stage's TP degree (default 1)."""
    fwd = sorted(set(pairs))
    bwd = sorted(set(grad_pairs)) if grad_pairs is not None else fwd
    tps = tps or [1] * len(stage_devices)
    s, j, u = a.stage, a.mb, tp_rank

    def src(stage: int) -> int:  # the one rank of `stage` this rank receives from
        ranks = _replica(stage_devices, tps, stage, j)
        return ranks[u % len(ranks)]

    def dsts(stage: int) -> list[int]:  # the ranks of `stage` that receive from this rank
        return [r for v, r in enumerate(_replica(stage_devices, tps, stage, j)) if v % tps[s] == u]

    recvs: list[Op] = []
    sends: list[Op] = []
    if a.kind == "F":
        recvs = [Op(False, src(p), Message("act", p, s, j)) for p, t in fwd if t == s]
        sends = [Op(True, r, Message("act", s, t, j)) for p, t in fwd if p == s for r in dsts(t)]
    elif a.kind == "B":
        recvs = [Op(False, src(t), Message("grad", t, s, j)) for p, t in bwd if p == s]
        sends = [Op(True, r, Message("grad", s, p, j)) for p, t in bwd if t == s for r in dsts(p)]
    return recvs, sends


def rank_programs(schedule: Mapping[int, Sequence[Action]], stage_devices: Sequence[Sequence[int]],
                  pairs: Iterable[tuple[int, int]], grad_pairs: Iterable[tuple[int, int]] | None = None,
                  loss_to_rank0: bool = True, tps: Sequence[int] | None = None) -> dict[int, list[Step]]:
    """Per rank, the issue/wait steps of the runtime's batched protocol (module docstring).
    `tps`: each stage's TP degree (default 1); the loss goes from each last-stage replica's
    first rank."""
    pairs = list(pairs)
    grad_pairs = list(grad_pairs) if grad_pairs is not None else None
    tps = list(tps) if tps is not None else [1] * len(stage_devices)
    last = len(stage_devices) - 1
    leaders = list(stage_devices[last][::tps[last]])
    tp_rank = {d: i % tps[s] for s, devs in enumerate(stage_devices) for i, d in enumerate(devs)}
    out: dict[int, list[Step]] = {}
    for rank, actions in schedule.items():
        ops = [action_ops(a, stage_devices, pairs, grad_pairs, tps, tp_rank.get(rank, 0))
               for a in actions]
        steps: list[Step] = []
        if ops and ops[0][0]:
            steps.append(Step("issue", tuple(ops[0][0]), str(actions[0])))
        all_sends: list[Op] = []
        for i, (recvs, sends) in enumerate(ops):
            if recvs:
                steps.append(Step("wait", tuple(recvs), str(actions[i])))
            batch = list(sends) + (list(ops[i + 1][0]) if i + 1 < len(ops) else [])
            if batch:
                steps.append(Step("issue", tuple(batch), str(actions[i])))
            all_sends += sends
        if all_sends:
            steps.append(Step("wait", tuple(all_sends), "flush"))
        if loss_to_rank0:
            if rank != 0 and rank in leaders:
                op = Op(True, 0, Message("loss", last, -1, rank))
                steps += [Step("issue", (op,), "loss"), Step("wait", (op,), "loss")]
            if rank == 0:  # one receive at a time, in replica order
                for r in leaders:
                    if r != 0:
                        op = Op(False, r, Message("loss", last, -1, r))
                        steps += [Step("issue", (op,), "loss"), Step("wait", (op,), "loss")]
        out[rank] = steps
    return out


def _check_order(programs: Mapping[int, Sequence[Step]]) -> None:
    """Each directed pair's k-th send is the receiver's k-th receive from that sender."""
    sent: dict[tuple[int, int], list[Message]] = {}
    got: dict[tuple[int, int], list[Message]] = {}
    for rank, steps in programs.items():
        for st in steps:
            if st.what != "issue":
                continue
            for op in st.ops:
                if op.send:
                    sent.setdefault((rank, op.peer), []).append(op.msg)
                else:
                    got.setdefault((op.peer, rank), []).append(op.msg)
    for key in sorted(set(sent) | set(got)):
        a, b = sent.get(key, []), got.get(key, [])
        for k, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                raise P2PError(
                    f"rank {key[0]} and rank {key[1]} post their messages in different orders: "
                    f"the {_nth(k)} message rank {key[0]} sends to rank {key[1]} is the {x}, but "
                    f"the {_nth(k)} one rank {key[1]} receives from rank {key[0]} is the {y} "
                    "(NCCL matches by order, not by tag: this plan would hang or corrupt data)")
        if len(a) != len(b):
            more, n = (f"rank {key[0]} sends", len(a)) if len(a) > len(b) else (f"rank {key[1]} receives", len(b))
            raise P2PError(f"{more} {n} messages between rank {key[0]} and rank {key[1]} but the "
                           f"other side only {min(len(a), len(b))}: a message nobody matches")


def _nth(k: int) -> str:
    n = k + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def check_programs(programs: Mapping[int, Sequence[Step]]) -> None:
    """Raise P2PError unless every operation of `programs` completes under the model of the
    module docstring (order matched per pair, rendezvous, one stream per rank)."""
    _check_order(programs)
    pc = {r: 0 for r in programs}  # next step of each rank's program
    queue: dict[int, list[list[Op]]] = {r: [] for r in programs}  # issued batches, not complete
    done: dict[int, set[Op]] = {r: set() for r in programs}
    progress = True
    while progress:
        progress = False
        for r, steps in programs.items():  # the CPU side: issue, and wait while nothing blocks
            while pc[r] < len(steps):
                st = steps[pc[r]]
                if st.what == "issue":
                    queue[r].append(list(st.ops))
                elif not all(op in done[r] for op in st.ops):
                    break
                pc[r] += 1
                progress = True
        heads = {r: set(q[0]) for r, q in queue.items() if q}
        matched = []
        for r, head in heads.items():  # rendezvous: both partners in their current batches
            for op in head:
                if op not in done[r] and Op(not op.send, r, op.msg) in heads.get(op.peer, ()):
                    matched.append((r, op))
        for r, op in matched:
            done[r].add(op)
            progress = True
        for r, q in queue.items():
            while q and all(op in done[r] for op in q[0]):
                q.pop(0)
                progress = True
    stuck = {r: pc[r] for r, steps in programs.items() if pc[r] < len(steps) or queue[r]}
    if stuck:
        lines = []
        for r in sorted(stuck)[:6]:
            if queue[r]:
                op = next(op for op in queue[r][0] if op not in done[r])
                lines.append(f"rank {r} waits to {op}, which rank {op.peer} has not issued "
                             "(it waits on something else first)")
            else:
                st = programs[r][pc[r]]
                lines.append(f"rank {r} waits in {st.action}")
        raise P2PError("the plan's point-to-point order deadlocks under NCCL: " + "; ".join(lines))


def check_schedule(schedule: Mapping[int, Sequence[Action | str]], stage_devices: Sequence[Sequence[int]],
                   pairs: Iterable[tuple[int, int]] | None = None,
                   grad_pairs: Iterable[tuple[int, int]] | None = None) -> None:
    """Check a schedule (rank -> actions or "1F3" strings); `pairs` default to the chain."""
    sched = {r: [a if isinstance(a, Action) else Action.parse(a) for a in acts]
             for r, acts in schedule.items()}
    if pairs is None:
        pairs = [(s - 1, s) for s in range(1, len(stage_devices))]
    check_programs(rank_programs(sched, stage_devices, pairs, grad_pairs))


def plan_pairs(plan: object) -> list[tuple[int, int]]:
    """The stage pairs of a plan that exchange tensors: its stages' `predicted.sends` with
    bytes, else the chain (s-1, s)."""
    stages = plan.stages  # type: ignore[attr-defined]
    pairs = []
    for st in stages:
        for snd in getattr(st.predicted, "sends", None) or []:
            if float(snd["bytes"]) > 0:
                pairs.append((st.index, int(snd["to"])))
    if not pairs and not any(getattr(st.predicted, "sends", None) for st in stages):
        pairs = [(s - 1, s) for s in range(1, len(stages))]
    return pairs


def check_plan(plan: object, pairs: Iterable[tuple[int, int]] | None = None) -> None:
    """Check a plan.json's rank actions (planner.formats.Plan; explicit lists or generator).
    `pairs`: the stage pairs that exchange tensors (the runtime knows them from the model);
    default `plan_pairs(plan)`."""
    from planner.schedules import plan_actions

    stage_devices = [list(st.devices) for st in plan.stages]  # type: ignore[attr-defined]
    pairs = plan_pairs(plan) if pairs is None else pairs
    tps = [getattr(st, "tp", 1) for st in plan.stages]  # type: ignore[attr-defined]
    check_programs(rank_programs(plan_actions(plan), stage_devices, pairs, tps=tps))  # type: ignore[arg-type]
