"""Bind each CPU rank to its own share of its node's cores (`PIPEPLAN_CPU_BIND=1`), as
DeepSpeed's `--bind_cores_to_rank` and Intel's launcher do for CPU training; off by default.

Why it is there: gloo's loop thread holds a connection's lock while it handles a message.
Unbound, the scheduler may leave that thread waiting for a core while its own rank's main
thread waits for the lock inside `dist.irecv`. On 2 cores with the GPT example on 2 stages,
binding cut those stalls from 28-41 to 7-21 per 20 steps, not to none; posting receives two
actions ahead (`runtime.executor`) took them out (0-2 per 30 steps) with or without binding,
and on top of it binding changed the iteration within noise (0.865 against 0.903x and 0.898
against 0.904x of the old iteration; `benchmarks/README.md`, "gloo_stalls.py").
Why it is off by default: two jobs on one machine (two runs, calibrate beside a run) would
both pin their local rank 0 to the first cores while others stay idle, and a pinned rank
cannot move off a core another job keeps busy.

Rules when on: only CPU ranks; only when every local rank of the node is allowed the same set
of CPUs (nobody bound them already, e.g. numactl or torchrun's NUMA binding), the node has at
least one CPU per local rank, and the rank's torch threads fit its share: local rank i gets
the i-th of `local_world_size` equal contiguous chunks of that set (CPUs left over by the
division stay unused).
"""

from __future__ import annotations

import os
from collections.abc import Callable

ENV = "PIPEPLAN_CPU_BIND"

RankCpus = tuple[str, int, tuple[int, ...]]  # (node, local rank, CPUs it may use)


def cores_for(ranks: list[RankCpus], me: int) -> tuple[int, ...] | None:
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


def default_threads(local_world_size: int) -> int:
    """Torch threads per rank: the CPUs this process may use over the ranks on its node."""
    return max(1, len(allowed_cpus() or range(os.cpu_count() or 1)) // max(local_world_size, 1))


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
    return os.environ.get(ENV, "0") == "1" and hasattr(os, "sched_setaffinity")


def bind_rank(rank: int, device_type: str, node: str, local_rank: int, threads: int,
              all_gather: Callable[[RankCpus], list[RankCpus]]) -> tuple[int, ...] | None:
    """Bind this CPU rank (see the module docstring) after the process group is up. With
    `PIPEPLAN_CPU_BIND=1` every rank must call it: it gathers each rank's node and CPUs with
    `all_gather`. Returns the CPUs bound to, or None."""
    if not enabled():
        return None
    me: RankCpus = (node, local_rank, allowed_cpus() if device_type == "cpu" else ())
    ranks = [(str(r[0]), int(r[1]), tuple(r[2])) for r in all_gather(me)]
    if not me[2]:
        return None
    cores = cores_for(ranks, rank)
    if cores and threads <= len(cores):
        bind_process(cores)
        return cores
    return None


def gather_all(obj: RankCpus) -> list[RankCpus]:
    """`obj` from every rank of the default process group; a dead peer is named as the
    runtime's other transfers name it."""
    import torch.distributed as dist

    from planner.errors import describe
    from runtime.comm import PeerError

    out: list[RankCpus] = [obj] * dist.get_world_size()
    try:
        dist.all_gather_object(out, obj)
    except RuntimeError as exc:
        raise PeerError(-1, "binding ranks to cores (PIPEPLAN_CPU_BIND=1): gathering every "
                            f"rank's CPUs failed ({describe(exc, 200)}); a peer has "
                            "died, raised an error or hangs") from None
    return out
