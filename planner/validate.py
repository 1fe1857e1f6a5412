"""Schedule validation: reject a schedule whose dependencies cannot be met.

Dependencies (ARCHITECTURE.md): `F(t, j)` needs `F(s, j)` for every stage pair `(s, t)` that
exchanges tensors (at least `(t-1, t)`); `B(s, j)` needs `F(s, j)` earlier *on the same rank*
(the activations live there) and `B(t, j)` for every pair `(s, t)`; `W(s, j)` (zero bubble:
the weight gradient) needs `B(s, j)` earlier on the same rank, and a rank that runs any W runs
one for each of its B's. Optionally the in-flight work per rank (forwards whose backward - B,
or W where split - has not run) is held to a limit. Errors print the
step x rank grid with the failing step(s) marked `>..<` (PyTorch pipelining's habit).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from planner.actions import Action
from planner.errors import PipeplanError


class ScheduleError(PipeplanError):
    """A schedule that cannot run: the message says why and shows the grid."""


Pos = tuple[int, int]  # (rank, step)


def format_grid(schedule: Mapping[int, Sequence[Action]], marks: Iterable[Pos] = (),
                max_steps: int = 60) -> str:
    """Steps down, ranks across; marked cells read `>1F3<`. Long schedules are cut around the
    first mark."""
    ranks = sorted(schedule)
    marked = set(marks)
    steps = max((len(a) for a in schedule.values()), default=0)
    first = min((s for _, s in marked), default=0)
    lo = max(0, min(first - max_steps // 2, steps - max_steps))
    hi = min(steps, lo + max_steps)
    width = max([len(f"rank {r}") for r in ranks] + [8])
    lines = ["step | " + " | ".join(f"rank {r}".center(width) for r in ranks)]
    if lo > 0:
        lines.append(f" ... ({lo} steps before)")
    for i in range(lo, hi):
        cells = []
        for r in ranks:
            acts = schedule[r]
            text = str(acts[i]) if i < len(acts) else ""
            if (r, i) in marked:
                text = f">{text}<"
            cells.append(text.center(width))
        lines.append(f"{i:4d} | " + " | ".join(cells))
    if hi < steps:
        lines.append(f" ... ({steps - hi} steps after)")
    return "\n".join(lines)


def _fail(schedule: Mapping[int, Sequence[Action]], message: str, marks: Iterable[Pos]) -> ScheduleError:
    return ScheduleError(f"invalid schedule: {message}\n{format_grid(schedule, marks)}")


def chain_deps(num_stages: int) -> set[tuple[int, int]]:
    return {(s - 1, s) for s in range(1, num_stages)}


def validate(schedule: Mapping[int, Sequence[Action | str]], num_stages: int | None = None,
             num_microbatches: int | None = None,
             deps: Iterable[tuple[int, int]] | None = None,
             max_inflight: Mapping[int, int] | None = None) -> dict[int, list[Action]]:
    """Check `schedule` (rank -> actions or strings like "1F3"); return it parsed.

    `deps` are the stage pairs `(s, t)` that exchange tensors (default: the chain). With
    `num_stages` and `num_microbatches`, every stage's forward and backward of every microbatch
    must be scheduled. `max_inflight[rank]`: the most microbatches that rank may hold between a
    forward and the end of its backward (the memory the plan was sized for)."""
    sched = {r: [a if isinstance(a, Action) else Action.parse(a) for a in acts]
             for r, acts in schedule.items()}
    stages_seen = {a.stage for acts in sched.values() for a in acts}
    S = num_stages if num_stages is not None else max(stages_seen, default=-1) + 1
    dep_pairs = set(deps) if deps is not None else chain_deps(S)
    producers: dict[int, list[int]] = {}
    consumers: dict[int, list[int]] = {}
    for s, t in dep_pairs:
        producers.setdefault(t, []).append(s)
        consumers.setdefault(s, []).append(t)

    where: dict[Action, Pos] = {}
    for r in sorted(sched):
        for i, a in enumerate(sched[r]):
            if a.stage >= S or (num_microbatches is not None and a.mb >= num_microbatches):
                raise _fail(sched, f"rank {r} step {i}: {a} is outside the pipeline "
                            f"({S} stages, {num_microbatches} microbatches)", [(r, i)])
            if a in where:
                r0, i0 = where[a]
                raise _fail(sched, f"{a} is scheduled twice (rank {r0} step {i0} and rank {r} "
                            f"step {i})", [(r0, i0), (r, i)])
            where[a] = (r, i)

    def needs(a: Action) -> list[Action]:
        if a.kind == "F":
            return [Action(s, "F", a.mb) for s in producers.get(a.stage, [])]
        if a.kind == "W":
            return [Action(a.stage, "B", a.mb)]
        return [Action(a.stage, "F", a.mb)] + [Action(t, "B", a.mb) for t in consumers.get(a.stage, [])]

    split_ranks = {r for r, acts in sched.items() if any(a.kind == "W" for a in acts)}
    for a, (r, i) in where.items():
        if a.kind == "W":
            b = Action(a.stage, "B", a.mb)
            pos = where.get(b)
            if pos is None or pos[0] != r or pos[1] > i:
                at = "no rank runs it" if pos is None else f"it is at rank {pos[0]} step {pos[1]}"
                raise _fail(sched, f"rank {r} step {i}: weight gradient {a} before its input "
                            f"gradient {b} on the same rank ({at})", [(r, i)] + ([pos] if pos else []))
        if a.kind == "B" and r in split_ranks and Action(a.stage, "W", a.mb) not in where:
            raise _fail(sched, f"rank {r} step {i}: {a} has no weight gradient "
                        f"{Action(a.stage, 'W', a.mb)} (a rank that splits its backward runs a W "
                        "for every B)", [(r, i)])
        if a.kind == "B":
            f = Action(a.stage, "F", a.mb)
            pos = where.get(f)
            if pos is None or pos[0] != r or pos[1] > i:
                at = "no rank runs it" if pos is None else f"it is at rank {pos[0]} step {pos[1]}"
                raise _fail(sched, f"rank {r} step {i}: backward {a} before its forward {f} on "
                            f"the same rank ({at})", [(r, i)] + ([pos] if pos else []))
        for d in needs(a):
            if d not in where:
                raise _fail(sched, f"rank {r} step {i}: {a} waits for {d}, which no rank runs "
                            "(a receive nobody sends)", [(r, i)])

    if num_microbatches is not None:
        for s in range(S):
            for j in range(num_microbatches):
                for kind in ("F", "B"):
                    a = Action(s, kind, j)  # type: ignore[arg-type]
                    if a not in where:
                        raise _fail(sched, f"{a} is never run: every stage must run the forward "
                                    "and backward of every microbatch", [])

    for r, limit in (max_inflight or {}).items():
        count = 0
        last = "W" if r in split_ranks else "B"
        for i, a in enumerate(sched.get(r, [])):
            count += 1 if a.kind == "F" else -1 if a.kind == last else 0
            if count > limit:
                raise _fail(sched, f"rank {r} step {i}: {count} microbatches in flight (forward "
                            f"done, backward not), more than the {limit} its memory allows",
                            [(r, i)])

    # run it in order, without time: a rank advances while its next action's inputs are done
    done: set[Action] = set()
    pointer = {r: 0 for r in sched}
    progress = True
    while progress:
        progress = False
        for r, acts in sched.items():
            i = pointer[r]
            while i < len(acts) and all(d in done for d in needs(acts[i])):
                done.add(acts[i])
                i += 1
            if i != pointer[r]:
                pointer[r] = i
                progress = True
    stuck = {r: i for r, i in pointer.items() if i < len(sched[r])}
    if stuck:
        waits = []
        for r, i in sorted(stuck.items()):
            a = sched[r][i]
            missing = [d for d in needs(a) if d not in done]
            waits.append(f"rank {r} step {i} ({a}) waits for {', '.join(map(str, missing))}")
        raise _fail(sched, "deadlock: " + "; ".join(waits), list(stuck.items()))
    return sched
