"""Ranks bound to their share of the node's CPUs: the rule (pure) and a real run's threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from runtime.cpu_binding import cores_for


def test_local_ranks_get_equal_contiguous_chunks_of_the_shared_set() -> None:
    cpus = tuple(range(8))
    ranks = [("a", i, cpus) for i in range(4)]
    assert [cores_for(ranks, r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_chunks_follow_local_rank_not_global_order_and_nodes_apart() -> None:
    a, b = (0, 1, 2), (4, 5, 6, 7)
    ranks = [("n1", 1, a), ("n1", 0, a), ("n2", 0, b), ("n2", 1, b)]
    assert cores_for(ranks, 0) == (1,)  # local rank 1 of 2 on 3 CPUs: the second chunk of 1
    assert cores_for(ranks, 1) == (0,)
    assert cores_for(ranks, 2) == (4, 5)
    assert cores_for(ranks, 3) == (6, 7)


def test_not_bound_when_off_or_threads_do_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.cpu_binding import bind_rank

    def gather(me: tuple) -> list:
        return [("a", 0, (0, 1)), ("a", 1, (0, 1))]

    monkeypatch.delenv("PIPEPLAN_CPU_BIND", raising=False)
    assert bind_rank(0, "cpu", "a", 0, 1, gather) is None  # off by default: nothing gathered
    monkeypatch.setenv("PIPEPLAN_CPU_BIND", "1")
    assert bind_rank(0, "cuda", "a", 0, 1, gather) is None  # GPU ranks are left alone
    here = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    if len(here) >= 2:  # a share of one CPU each; --threads 2 does not fit it: left unbound
        def two(me: tuple) -> list:
            return [("a", 0, here), ("a", 1, here)]

        try:
            assert bind_rank(0, "cpu", "a", 0, len(here), two) is None
            assert tuple(sorted(os.sched_getaffinity(0))) == here
        finally:
            os.sched_setaffinity(0, here)


def test_not_bound_when_oversubscribed_or_already_bound() -> None:
    assert cores_for([("a", i, (0, 1)) for i in range(4)], 0) is None  # more ranks than CPUs
    # someone (numactl, torchrun) bound the ranks already: their sets differ
    assert cores_for([("a", 0, (0, 1)), ("a", 1, (2, 3))], 0) is None
    # ranks that cannot be told apart
    assert cores_for([("a", 0, (0, 1)), ("a", 0, (0, 1))], 0) is None


SCRIPT = textwrap.dedent("""
    import os, sys, torch.distributed as dist
    from runtime import comm, cpu_binding
    import torch
    rank = int(os.environ["RANK"])
    comm.init_process_group("gloo", torch.device("cpu"), rank, 2, 60)
    got = cpu_binding.bind_rank(rank, "cpu", "node", rank, 1, cpu_binding.gather_all)
    sets = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
    print(rank, got, sorted(sets), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and 2 CPUs")
@pytest.mark.parametrize("switch", ["1", "0"])
def test_every_thread_of_a_rank_is_bound_or_none_is(switch: str) -> None:
    """Two real gloo ranks: with PIPEPLAN_CPU_BIND=1 each binds all its threads (gloo's loop
    included) to its own half of the CPUs; with 0 (the default) nothing changes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               PIPEPLAN_CPU_BIND=switch)
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    for r, (out, _) in enumerate(outs):
        line = out.strip().splitlines()[-1]
        if switch == "1":
            mine = tuple(cpus[r * half:(r + 1) * half])
            assert line == f"{r} {mine} {[mine]}"
        else:
            assert line == f"{r} None {[tuple(cpus)]}"
