"""Which errors of a collective step are a peer's (the launcher then names the rank that hangs
or died) and which stay this rank's own."""

from __future__ import annotations

import os

import pytest
import torch

from runtime import comm


@pytest.mark.parametrize(("exc", "peer"), [
    (RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms for send"), True),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"), True),
    (torch.distributed.DistStoreError("wait timeout after 10000ms, keys: /default_pg/0//cpu//0/1"), True),
    (RuntimeError("NCCL error: remote process exited or there was a network error, Connection reset by peer"), True),
    # NCCL's asynchronous error (ncclCommGetAsyncError) names no socket: its "Last error" is empty
    (RuntimeError("NCCL error: remote process exited or there was a network error, NCCL version 2.27.3\n"
                  "ncclRemoteError: A call failed possibly due to a network error or a remote process "
                  "exiting prematurely.\nLast error:\n"), True),
    # this rank's own: gathering a large checkpoint on rank 0 ran out of memory; NCCL would not start
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"), False),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"), False),
])
def test_only_a_peer_s_failure_becomes_a_peer_error(exc: RuntimeError, peer: bool) -> None:
    assert comm.peer_failure(exc) is peer
    with pytest.raises(comm.PeerError if peer else type(exc)):
        with comm.collective("a step", 3.0):
            raise exc


def test_an_allocation_inside_a_collective_step_stays_this_rank_s_error() -> None:
    with pytest.raises(RuntimeError, match="allocat") as got:
        with comm.collective("collecting the checkpoint's parts on rank 0 (--save)", 3.0):
            torch.empty(1 << 60, dtype=torch.uint8)
    assert not isinstance(got.value, comm.PeerError)


@pytest.mark.parametrize(("backend", "forced", "batched"), [
    ("gloo", None, False), ("nccl", None, True), ("gloo", "1", True), ("gloo", "0", False),
    ("nccl", "1", True),
])
def test_the_point_to_point_protocol_of_each_backend(monkeypatch, backend, forced, batched) -> None:
    if forced is None:
        monkeypatch.delenv("PIPEPLAN_P2P_BATCHED", raising=False)
    else:
        monkeypatch.setenv("PIPEPLAN_P2P_BATCHED", forced)
    assert comm.batched_protocol(backend) is batched


def test_the_unbatched_protocol_is_refused_on_nccl(monkeypatch) -> None:
    """Its receives posted ahead sit on NCCL's one stream before the sends that feed them."""
    from planner.errors import PipeplanError

    monkeypatch.setenv("PIPEPLAN_P2P_BATCHED", "0")
    with pytest.raises(PipeplanError, match="PIPEPLAN_P2P_BATCHED=0 on NCCL"):
        comm.batched_protocol("nccl")


@pytest.mark.parametrize(("ours", "waited_by_torch", "seen"), [
    (True, True, None),  # a TP group: torch waits for its collectives, without 1 ms polls
    (True, False, "1"),  # the runtime's own groups keep the blocking waits it names peers by
    (False, True, "1"),  # the user's own TORCH_NCCL_BLOCKING_WAIT is kept everywhere
])
def test_blocking_waits_of_the_groups_the_runtime_makes(monkeypatch, ours, waited_by_torch, seen):
    """ProcessGroupNCCL reads TORCH_NCCL_BLOCKING_WAIT when it is made: what a new group sees."""
    got = []
    monkeypatch.setattr(torch.distributed, "new_group",
                        lambda ranks, **kw: got.append(os.environ.get("TORCH_NCCL_BLOCKING_WAIT")))
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    monkeypatch.setattr(comm, "_OUR_BLOCKING_WAIT", ours)
    comm.new_group([0, 1], torch.device("cuda", 0), waited_by_torch=waited_by_torch)
    assert got == [seen] and os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"


class _Work:
    """A transfer that completes after `polls` queries of `is_completed`."""

    def __init__(self, polls: int) -> None:
        self.polls, self.queried, self.waited_while_pending = polls, 0, False

    def is_completed(self) -> bool:
        self.queried += 1
        return self.queried > self.polls

    def wait(self) -> bool:
        self.waited_while_pending = self.queried <= self.polls
        return True


def test_a_cuda_wait_polls_completion_itself_before_nccl_s_blocking_wait() -> None:
    """NCCL's blocking wait sleeps 1 ms per poll: on CUDA the runtime polls finely first and
    calls wait() only once the transfer is complete (it then returns at once)."""
    w = _Work(polls=50)
    comm.wait_work(w, torch.device("cuda", 0), 5.0)
    assert w.queried == 51 and not w.waited_while_pending
    cpu = _Work(polls=50)  # gloo: its own wait, untouched
    comm.wait_work(cpu, torch.device("cpu"), 5.0)
    assert cpu.queried == 0


def test_a_cuda_wait_that_never_completes_times_out_as_a_peer_s() -> None:
    with pytest.raises(RuntimeError, match="timed out") as got:
        comm.wait_work(_Work(polls=10**9), torch.device("cuda", 0), 0.05)
    assert comm.peer_failure(got.value)
    p2p = comm.P2P(0, torch.device("cuda", 0), {"x": 0}, 0.05)
    with pytest.raises(comm.PeerError, match="no answer within 0.05 s"):
        p2p._wait(comm._Pending(_Work(polls=10**9), torch.empty(0), 1, "receiving 'x'"))


def _gather_on_host_group(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group = comm.host_group("nccl", world)  # as on NCCL: a gloo group of every rank
        parts: list[object] = [None] * world
        dist.gather_object({"rank": rank, "t": torch.full((3,), float(rank))},
                           parts if rank == 0 else None, dst=0, group=group)
        if rank == 0:
            torch.save((dist.get_backend(group), parts), out)
    finally:
        dist.destroy_process_group()


def test_the_host_objects_are_gathered_over_gloo_on_nccl(tmp_path) -> None:
    """Rank 0 gathers the checkpoint's parts through host memory on NCCL too (a gloo group):
    over NCCL gather_object receives world x the largest part on rank 0's GPU."""
    import torch.multiprocessing as mp

    assert comm.host_group("gloo", 2) is None  # the default group, gloo already
    out = tmp_path / "parts.pt"
    mp.spawn(_gather_on_host_group, args=(2, f"file://{tmp_path / 'store'}", str(out)), nprocs=2)
    backend, parts = torch.load(out)
    assert backend == "gloo"
    assert [p["rank"] for p in parts] == [0, 1]
    assert torch.equal(parts[1]["t"], torch.ones(3))
