"""Bind each CPU rank to its own share of its node's cores, as DeepSpeed's `--bind_cores_to_rank`
and Intel's launcher do for CPU training.

Why: gloo's loop thread holds a connection's lock while it handles a message. Unbound, the
scheduler may queue that thread behind another rank's busy compute thread while its own rank's
main thread waits for the lock inside `dist.irecv` (a receive being posted). Measured on 2 cores
with the GPT example on 2 stages: `dist.irecv` blocked 1.4-5.5 ms at a time, a few times per
step, with ~0.05 ms of CPU used (strace: the main thread in a contended futex while the loop
thread held it without running); the iteration was 45-48 ms against 35-38 ms bound, and no
such stall was left bound (`benchmarks/README.md`, "Ranks bound to cores"). Bound, a rank's
loop thread shares a core only with its own main thread, which is waiting for it.

Rules: only CPU ranks; only when every local rank of the node is allowed the same set of CPUs
(nobody bound them already, e.g. with numactl or torchrun's NUMA binding) and the node has at
least one CPU per local rank: local rank i gets the i-th of `local_world_size` equal contiguous
chunks of that set. With more ranks than CPUs nothing is bound (the scheduler balances better).
`PIPEPLAN_CPU_BIND=0` turns it off.
"""

from __future__ import annotations

import os

ENV = "PIPEPLAN_CPU_BIND"


def cores_for(ranks: list[tuple[str, int, tuple[int, ...]]], me: int) -> tuple[int, ...] | None:
    """The CPUs rank `me` binds to, from every rank's (node, local rank, allowed CPUs); None: do
    not bind (pure)."""
    node, local, allowed = ranks[me]
    peers = [r for r in ranks if r[0] == node]
    if any(r[2] != allowed for r in peers) or len({r[1] for r in peers}) != len(peers):
        return None  # bound already by someone else, or local ranks not told apart
    cpus = sorted(allowed)
    n = len(peers)
    if n > len(cpus):
        return None
    k = len(cpus) // n
    index = sorted(r[1] for r in peers).index(local)
    return tuple(cpus[index * k:(index + 1) * k])


def allowed_cpus() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()


def bind_process(cores: tuple[int, ...]) -> None:
    """Every thread of this process (gloo's, torch's) on `cores`; threads started later inherit
    the main thread's."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that has exited meanwhile
            pass


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and hasattr(os, "sched_setaffinity")


def default_threads(local_world_size: int) -> int:
    """Torch threads per rank: the CPUs this process may use over the ranks on its node."""
    return max(1, len(allowed_cpus() or range(os.cpu_count() or 1)) // max(local_world_size, 1))


def bind_rank(rank: int, device_type: str, node: str, local_rank: int, all_gather: object
              ) -> tuple[int, ...] | None:
    """Bind this CPU rank (see the module docstring) after the process group is up; every rank
    must call it (it gathers each rank's node and CPUs with `all_gather(obj) -> list`).
    Returns the CPUs bound to, or None."""
    me = (node, local_rank, allowed_cpus() if enabled() and device_type == "cpu" else ())
    ranks = all_gather(me)  # type: ignore[operator]
    if not me[2]:
        return None
    cores = cores_for([tuple(r) for r in ranks], rank)  # type: ignore[misc]
    if cores:
        bind_process(cores)
    return cores


def gather_all(obj: object) -> list[object]:
    """`obj` from every rank of the default process group."""
    import torch.distributed as dist

    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
