"""Calibrate's pipeline probe: what a message costs inside a running pipeline.

Internal module (`python -m runtime calibrate` runs it last). A ping-pong measures a message
between two ranks that do nothing else; in a pipeline the ranks compute between messages, and
on a machine with few cores per rank (a CPU box, our 2 cores) the transport's threads and the
waiting rank then wake up late. `planner refine` has fitted that cost from runs of the README
job at 0.35-1.05 ms per message against a ping-pong's ~0.13 ms; the probe measures it before
any plan exists, the same way:

1. every rank of the job is one stage of a chain (rank r is stage r), each stage an MLP block
   (forward and backward through autograd) on microbatches of `batch` x `dim` floats, the
   activations sent forward and the gradients back over the runtime's own channel
   (`runtime.comm.P2P`), issued by the executor's own loop (`runtime.executor.drive`); 1F1B
   from `planner.schedules`, as a plan would run it (`planner.p2p_order` checks the chain's
   order in the tests);
2. per rank, the median forward and backward of a microbatch (timed around the compute, as the
   runtime's report times a stage), and the median iteration (the slowest rank's, from a
   barrier to its sends delivered);
3. `fit_overhead`: the delay per message, on top of each hop's calibrated latency and
   bandwidth, with which the planner's simulator, given the measured forward and backward
   times, gives the measured iteration (bisection: the simulated time grows with it): the
   cluster's `p2p_overhead_us`, which refine later fits from the real run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from planner.cost import PipelineCosts, Send, transfer_ms
from planner.schedules import generate, generate_rank
from planner.simulator import simulate_costs

SCHEDULE = "1f1b"
MICROBATCHES = 8
BATCH = 32  # rows per microbatch: forward ~0.6 ms, backward ~1.1 ms on one core of ours
DIM = 256
WARMUP = 3  # iterations not counted
KEY = "x"


def _chain(world: int) -> list[tuple[int]]:
    """Stage devices of the probe's plan: rank r is stage r."""
    return [(r,) for r in range(world)]


def chain_schedule(world: int, microbatches: int) -> dict[int, list[Any]]:
    """Rank r's actions when rank r is stage r of a chain (the probe's plan)."""
    return generate(SCHEDULE, _chain(world), microbatches)


def simulated_ms(fwd_ms: Sequence[float], bwd_ms: Sequence[float], microbatches: int,
                 nbytes: float, hops: Sequence[tuple[float, float]], overhead_us: float) -> float:
    """The simulator's iteration of the probe's chain; `hops[r-1]` = (latency us, GB/s) of the
    link from rank r-1 to rank r; every message pays `overhead_us` more."""
    world = len(fwd_ms)
    costs = PipelineCosts(
        stage_devices=tuple(_chain(world)), num_microbatches=microbatches,
        fwd_ms=tuple(fwd_ms), bwd_ms=tuple(bwd_ms), allreduce_ms=(0.0,) * world,
        static_memory_bytes=(0.0,) * world, activation_bytes_per_microbatch=(0.0,) * world,
        memory_limit_bytes=(float("inf"),) * world,
        sends={(r - 1, r): Send(nbytes, transfer_ms(nbytes, hops[r - 1][1], hops[r - 1][0] + overhead_us))
               for r in range(1, world)})
    return simulate_costs(costs, chain_schedule(world, microbatches)).iteration_ms


def fit_overhead(fwd_ms: Sequence[float], bwd_ms: Sequence[float], microbatches: int,
                 nbytes: float, hops: Sequence[tuple[float, float]], iteration_ms: float,
                 iters: int = 60) -> float:
    """The per-message overhead (us) with which `simulated_ms` equals `iteration_ms`; 0 when
    even no overhead simulates slower than measured (pure)."""
    if len(fwd_ms) < 2:
        return 0.0

    def sim(us: float) -> float:
        return simulated_ms(fwd_ms, bwd_ms, microbatches, nbytes, hops, us)

    if sim(0.0) >= iteration_ms:
        return 0.0
    lo, hi = 0.0, iteration_ms * 1e3  # one message delayed by the whole iteration is too much
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if sim(mid) < iteration_ms:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def priced(probe: dict, hops: Sequence[tuple[float, float]]) -> dict:
    """`run`'s measurements with the links it crossed (`hops`, as in `simulated_ms`), the
    simulated iteration without overhead and the fitted `p2p_overhead_us` (pure)."""
    args = (probe["fwd_ms"], probe["bwd_ms"], probe["microbatches"], probe["bytes"], hops)
    return probe | {"hops": [list(h) for h in hops],
                    "simulated_without_overhead_ms": simulated_ms(*args, 0.0),
                    "p2p_overhead_us": fit_overhead(*args, probe["iteration_ms"])}


def run(torch: Any, dist: Any, me: int, world: int, device: Any, timeout_s: float,
        iterations: int = 60, microbatches: int = MICROBATCHES, batch: int = BATCH,
        dim: int = DIM) -> dict | None:
    """Every rank runs the probe's pipeline; rank 0 returns what it measured (per rank forward
    and backward ms, iteration ms), the others None."""
    from runtime import comm
    from runtime.executor import drive, recv_lookahead

    actions = generate_rank(SCHEDULE, _chain(world), microbatches, me)
    gen = torch.Generator().manual_seed(1000 + me)
    block = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                torch.nn.Linear(4 * dim, dim))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    block = block.to(device)
    x0 = torch.randn(batch, dim, generator=gen).to(device)
    p2p = comm.P2P(me, device, {KEY: 0}, timeout_s,
                   describe_rank={r: f"rank {r} (calibrate's pipeline probe)" for r in range(world)},
                   batched=comm.batched_protocol("nccl" if device.type == "cuda" else "gloo"))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def post(a: Any) -> None:
        if a.kind == "F" and me > 0:
            p2p.post_recv(me - 1, a.mb, KEY, grad=False)
        elif a.kind == "B" and me < world - 1:
            p2p.post_recv(me + 1, a.mb, KEY, grad=True)

    fwd: list[float] = []
    bwd: list[float] = []

    held: dict[int, tuple[Any, Any]] = {}

    def act(a: Any) -> float:
        if a.kind == "F":
            x = p2p.recv(me - 1, a.mb, KEY, grad=False) if me > 0 else x0
            x = x.detach().requires_grad_(me > 0)
            sync()
            t0 = time.perf_counter()
            y = block(x)
            sync()
            fwd.append((time.perf_counter() - t0) * 1e3)
            held[a.mb] = (x, y)
            if me < world - 1:
                p2p.send(y, me + 1, a.mb, KEY, grad=False)
        else:
            x, y = held.pop(a.mb)
            g = p2p.recv(me + 1, a.mb, KEY, grad=True) if me < world - 1 else torch.ones_like(y)
            sync()
            t0 = time.perf_counter()
            y.backward(g)
            sync()
            bwd.append((time.perf_counter() - t0) * 1e3)
            if me > 0:
                p2p.send(x.grad, me - 1, a.mb, KEY, grad=True)
        return 0.0

    def one_iteration() -> float:
        comm.barrier(device)
        t_start = time.perf_counter()
        drive(actions, p2p, recv_lookahead(device), post, act)  # the executor's issue order
        p2p.flush()
        sync()
        return (time.perf_counter() - t_start) * 1e3

    mine = [one_iteration() for _ in range(WARMUP + iterations)][WARMUP:]
    n_skip = WARMUP * microbatches
    row = (mine, statistics.median(fwd[n_skip:]), statistics.median(bwd[n_skip:]))
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    if me != 0:
        return None
    its = [max(r[0][k] for r in rows) for k in range(iterations)]  # the slowest rank's
    return {"schedule": SCHEDULE, "microbatches": microbatches, "batch": batch, "dim": dim,
            "bytes": batch * dim * 4, "iterations": iterations,
            "fwd_ms": [r[1] for r in rows], "bwd_ms": [r[2] for r in rows],
            "iteration_ms": statistics.median(its), "iteration_range_ms": [min(its), max(its)]}
