"""`python -m runtime calibrate --nproc-per-node N -o cluster.json`: measure the cluster the
runtime will really use and write it as a cluster.json.

Without a torch.distributed environment it starts N local ranks (as `python -m runtime` does);
under torchrun (RANK, WORLD_SIZE, ... set, any number of nodes) it is one rank. The backend is
the runtime's: NCCL when every local rank has a GPU, else gloo. It measures, with every rank
started:

- point-to-point, per link class (same node: the first two ranks of node 0; across nodes:
  rank 0 and the first rank of node 1): one-way time of a message of n bytes for n from 256 B
  to 4 MB, each as a *cold* ping-pong (the receiver has been blocked in its wait, as a
  pipeline stage waiting for its input is; round trip minus the responder's idle time, halved,
  so clocks need not agree across nodes); fitted as `alpha + n / bandwidth` by least squares
  on the relative error;
- all-reduce of 1 and 4 MB over all ranks (one node) or one rank per node: its time against
  the ring formula with the fitted link gives `allreduce_efficiency`;
- each device's speed relative to the profiled device: a fixed workload (an MLP's forward and
  backward, or with `--profile P --model M` the profiled model's at the profile's batch size)
  timed on every rank *at once*, against the same workload alone on rank 0 (both for at least
  1.5 s after a warm-up, so neither is measured cold) — or, when the
  profile was made on another kind of device, against the profile's measured time of it. On
  a CPU box with more ranks than cores this is the oversubscription;
- usable memory per device: free GPU memory, or the machine's available memory shared by its
  local ranks (`--memory-gb` overrides, e.g. to plan as if devices were smaller);
- what a message costs inside a running pipeline (`runtime.pipeline_probe`, with two or more
  ranks): every rank a stage of a 1F1B chain of MLP blocks over the runtime's own channel,
  and the per-message delay on top of the fitted links with which the planner's simulator
  reproduces the measured iteration, written as `p2p_overhead_us` (what `planner refine`
  fits from a real run; on our 2 cores 0.65-1.22 ms with 2 ranks, ~1.4 ms with 4, against a
  ping-pong's 0.13-0.31 ms).

Rank 0 writes cluster.json (uniform form on one node or equal nodes, the list form when nodes
differ; `latency_us` is the smallest class latency so bounds stay valid; the class latencies,
bandwidths, `allreduce_efficiency` and everything measured under `calibration`) and prints the
figures beside the nominal ones (`--nominal cluster.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from planner.errors import OneLineParser, PipeplanError
from planner.io import write_text_atomic
from planner.limits import MIN_POSITIVE, small_divisor

if TYPE_CHECKING:
    from runtime.comm import PeerError

SIZES = [256, 4096, 65536, 262144, 1 << 20, 4 << 20]  # bytes per message
IDLE_MS = 2.0  # how long a receiver has been blocked before a cold message arrives
MAX_ROUNDS = 10_000  # --rounds at most, as profile --repeats
# all-reduces per size, per --rounds. Ten calibrations of 4 ranks on our 2 cores, alternating
# 15 and 60 rounds: bandwidth 2.77-3.15 / 2.82-3.07 GB/s, all-reduce efficiency 0.38-0.53 /
# 0.39-0.47; five more with 60 rounds and 3x the all-reduces: efficiency 0.37-0.43
AR_ROUNDS = 3


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m runtime calibrate",
        description="Measure this cluster's links, all-reduce, device speed and memory as the "
                    "runtime will use them; write cluster.json.")
    p.add_argument("-o", "--output", default="cluster.json", help="where to write (cluster.json)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks to start on this machine (default: the GPUs, else the CPU cores); "
                        "ignored under torchrun")
    p.add_argument("--profile", help="profile.json: measure speed with its model (needs --model)")
    p.add_argument("--model", help="the model.py of --profile")
    p.add_argument("--nominal", help="a cluster.json with the nominal figures to print beside")
    p.add_argument("--memory-gb", type=float, help="usable memory per device to write instead "
                   "of the measured one")
    p.add_argument("--rounds", type=int, default=60,  # at most MAX_ROUNDS
                   help="messages per size (default 60; all-reduces: 3x as many; iterations of "
                        "the pipeline probe: as many, at least 10)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a rank waits for a peer before it gives up (default 120)")
    return p


# ---------------------------------------------------------------- pure fitting


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """`(alpha_us, gb_per_s)` of `t_us = alpha + bytes / (gb_per_s * 1e3)` fitted to
    `(bytes, t_us)` points by least squares on the relative error (weights 1/t^2); alpha is
    kept >= 0 and the bandwidth finite."""
    w = [1.0 / max(t, 1e-9) ** 2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / det if det > 0 else 0.0  # us per byte
    alpha = (sy - beta * sx) / sw
    if alpha < 0:  # refit the slope through the origin
        alpha = 0.0
        beta = sxy / sxx if sxx > 0 else 0.0
    beta = max(beta, 1e-9)  # no faster than 1e6 GB/s
    return alpha, 1.0 / (beta * 1e3)


def ring_allreduce_us(nbytes: float, ranks: int, alpha_us: float, gb_per_s: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / (gb_per_s * 1e3) + 2 * (ranks - 1) * alpha_us


# ---------------------------------------------------------------- measurements (one rank)


def _pingpong(dist: object, torch: object, me: int, a: int, b: int, nbytes: int, rounds: int,
              device: object, tag0: int, timeout_s: float) -> list[float]:
    """Cold one-way times (us) of `nbytes` messages between ranks a and b (a measures)."""
    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)  # type: ignore[attr-defined]
    out = []
    peer = b if me == a else a

    def done(work: object, what: str) -> None:
        from runtime.comm import wait_work

        try:  # (on CUDA polled finely: NCCL's blocking wait sleeps 1 ms per poll, `wait_work`)
            wait_work(work, device, timeout_s)  # type: ignore[arg-type]
        except RuntimeError as exc:  # gloo/NCCL: a timeout or a closed connection
            raise _peer_error(peer, f"{what} rank {peer} ({nbytes} B messages)", exc, timeout_s) from None

    for i in range(rounds + 2):
        tag = tag0 + i
        if me == a:
            time.sleep(IDLE_MS / 1e3)  # b is blocked in its receive meanwhile
            _sync(torch, device)
            t0 = time.perf_counter()
            done(dist.isend(buf, b, tag=tag), "sending to")  # type: ignore[attr-defined]
            done(dist.irecv(buf, b, tag=tag), "receiving from")  # type: ignore[attr-defined]
            _sync(torch, device)
            rtt = (time.perf_counter() - t0) * 1e6
            if i >= 2:  # warm-up
                out.append(max((rtt - IDLE_MS * 1e3) / 2, 0.0))
        elif me == b:
            done(dist.irecv(buf, a, tag=tag), "receiving from")  # type: ignore[attr-defined]
            _sync(torch, device)
            time.sleep(IDLE_MS / 1e3)  # a is blocked in its receive meanwhile
            done(dist.isend(buf, a, tag=tag), "sending to")  # type: ignore[attr-defined]
            _sync(torch, device)
    return out


def _peer_error(peer: int, what: str, exc: BaseException, timeout_s: float) -> PeerError:
    """A failed transfer of the calibration as the runtime reports one: the peer named, one line."""
    from runtime.comm import PeerError, failure_reason

    return PeerError(peer, f"calibrate, {what}: {failure_reason(exc, timeout_s)}; rank {peer} has "
                           "died, raised an error or hangs")


def _sync(torch: object, device: object) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)  # type: ignore[attr-defined]


def _reference_workload(torch: object, device: object) -> object:
    """An MLP forward + backward of ~10-30 ms on one CPU thread (fixed seed and sizes)."""
    nn = torch.nn  # type: ignore[attr-defined]
    torch.manual_seed(0)  # type: ignore[attr-defined]
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                            for _ in range(4)]).to(device)
    x = torch.randn(64, 256, device=device)  # type: ignore[attr-defined]

    def step() -> None:
        model(x).square().mean().backward()
    return step


def _model_workload(torch: object, device: object, profile_path: str, model_path: str
                    ) -> tuple[object, float, tuple[str, str]]:
    """The profiled model's forward + backward (with its loss) at the profile's batch size, the
    profile's measured time of the same (ms) and the profiled device (type, name)."""
    from planner.formats import Profile
    from planner.io import load_model
    from profiler.loader import batch_checked, build_checked, load_model_file

    profile = load_model(profile_path, Profile, f"profile {profile_path}")
    if profile.measured is None:
        raise PipeplanError(f"--profile {profile_path} has no whole-model measurement (measured); "
                            "profile the model again with python -m planner profile")
    mf = load_model_file(model_path)
    torch.manual_seed(0)  # type: ignore[attr-defined]
    model = build_checked(mf, profile.batch_size).to(device)
    inputs, target = batch_checked(mf, profile.batch_size)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)  # type: ignore[attr-defined]
    inputs = tuple(x.to(device) for x in inputs)
    target = target.to(device)

    def step() -> None:
        mf.loss_fn(model(*inputs), target).backward()
    ref = profile.measured.fwd_ms + profile.measured.bwd_ms
    ref += float(getattr(profile.measured, "loss_ms", 0.0) or 0.0)
    return step, ref, (profile.device.type, profile.device.name)


def _time_ms(step: object, torch: object, device: object, repeats: int, window_s: float = 0.0
             ) -> float:
    """Median time of `step` over `repeats` runs, and at least `window_s` seconds of them (so
    ranks started together keep running together)."""
    for _ in range(2):
        step()  # type: ignore[operator]
    times: list[float] = []
    end = time.perf_counter() + window_s
    while len(times) < repeats or time.perf_counter() < end:
        _sync(torch, device)
        t0 = time.perf_counter()
        step()  # type: ignore[operator]
        _sync(torch, device)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def _memory_bytes(torch: object, device: object, local_world: int) -> float:
    if getattr(device, "type", "cpu") == "cuda":
        free, _ = torch.cuda.mem_get_info(device)  # type: ignore[attr-defined]
        return float(free)
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = float(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return avail / max(local_world, 1)


def rank_main(args: argparse.Namespace) -> dict | None:
    """One rank's part; rank 0 returns the measurements, the others None."""
    import torch
    import torch.distributed as dist

    from runtime import comm
    from runtime.worker import DistEnv, _device, node_key, start_rank

    env = DistEnv.from_environ()
    device, backend = _device(env)
    start_rank(env, device, backend, args.timeout)  # as the runtime's ranks: measured as a run sees it
    me, world = env.rank, env.world_size
    hosts: list[object] = [None] * world
    # a node: torchrun's GROUP_RANK where set (containers may share a host name), and the host
    with comm.collective("calibrate, gathering every rank's node", args.timeout):
        dist.all_gather_object(hosts, (node_key(), env.local_world_size))
    names = [h[0] for h in hosts]  # type: ignore[index]
    node_names = list(dict.fromkeys(names))
    node_of = [node_names.index(n) for n in names]
    ranks_of_node = [[r for r in range(world) if node_of[r] == n] for n in range(len(node_names))]

    def say(what: str) -> None:  # progress, from rank 0: many ranks on few cores take minutes
        if me == 0:
            print(f"  {what} ...", flush=True)

    # the workload of the speed measurement; ranks outside a measured pair run it meanwhile, so
    # messages travel while the other devices compute, as in a pipeline (on a CPU box with
    # fewer cores than ranks that is what makes a waiting rank wake up late)
    from profiler.profile import device_name

    profiled: tuple[str, str] | None = None
    if args.profile:
        step, ref_ms, profiled = _model_workload(torch, device, args.profile, args.model)
    else:
        step, ref_ms = _reference_workload(torch, device), None
    store = dist.distributed_c10d._get_default_store()  # type: ignore[attr-defined]

    pairs: dict[str, tuple[int, int]] = {}
    if len(ranks_of_node[0]) >= 2:
        pairs["intra"] = (ranks_of_node[0][0], ranks_of_node[0][1])
    if len(ranks_of_node) >= 2:
        pairs["inter"] = (ranks_of_node[0][0], ranks_of_node[1][0])
    links: dict[str, dict] = {}
    if pairs:
        say(f"point-to-point latency and bandwidth ({', '.join(pairs)}-node)")
    tag = 1000  # the same on every rank: a pair's tags do not depend on who measured before
    for kind, (a, b) in pairs.items():
        points = []
        done_key = f"pipeplan-calibrate-{kind}-done"
        first_tag, tag = tag, tag + len(SIZES) * (args.rounds + 2)
        if me in (a, b):
            for k, nbytes in enumerate(SIZES):
                ts = _pingpong(dist, torch, me, a, b, nbytes, args.rounds, device,
                               first_tag + k * (args.rounds + 2), args.timeout)
                if me == a:
                    points.append((float(nbytes), float(statistics.median(ts))))
            if me == a:
                store.set(done_key, "1")
        else:
            while not store.check([done_key]):
                step()  # type: ignore[operator]
            _sync(torch, device)
        comm.barrier(device)
        if me == a:
            alpha, gbps = fit_alpha_beta(points)
            links[kind] = {"ranks": [a, b], "latency_us": alpha, "gb_per_s": gbps,
                           "points_us": [[int(x), t] for x, t in points]}
    box: list[object] = [links]
    with comm.collective("calibrate, sharing the links measured", args.timeout):
        dist.broadcast_object_list(box, src=0)  # rank 0 is `a` of every pair
    links = box[0]  # type: ignore[assignment]

    # all-reduce over one group of replicas: the whole node, or one rank per node
    ar: dict = {}
    group_ranks = ranks_of_node[0] if len(ranks_of_node) == 1 else [rs[0] for rs in ranks_of_node]
    kind = "intra" if len(ranks_of_node) == 1 else "inter"
    group = comm.new_group(group_ranks, device) if len(group_ranks) >= 2 else None
    if group is not None and kind in links:
        say(f"all-reduce over {len(group_ranks)} ranks")
        eff = []
        for nbytes in (1 << 20, 4 << 20):
            t = torch.ones(nbytes // 4, device=device)
            ms = []
            for _ in range(AR_ROUNDS * max(args.rounds, 10) + 3):
                if me in group_ranks:
                    _sync(torch, device)
                    t0 = time.perf_counter()
                    with comm.collective("calibrate, measuring the all-reduce", args.timeout):
                        comm.wait_work(dist.all_reduce(t, group=group, async_op=True), device,
                                       args.timeout)
                    _sync(torch, device)
                    ms.append((time.perf_counter() - t0) * 1e6)
            if me in group_ranks:
                meas = float(statistics.median(ms[3:]))
                formula = ring_allreduce_us(nbytes, len(group_ranks), links[kind]["latency_us"],
                                            links[kind]["gb_per_s"])
                eff.append((nbytes, meas, formula))
        if me == 0:
            ar = {"ranks": group_ranks, "link": kind,
                  "points_us": [[n, m, f] for n, m, f in eff],
                  "efficiency": min(1.0, statistics.median(f / m for _, m, f in eff))}
    comm.barrier(device)

    # device speed: the workload on every rank at once, against it alone on rank 0
    say(f"each device's speed, alone and with all {world} ranks busy")
    solo = _time_ms(step, torch, device, 7, window_s=1.5) if me == 0 else None
    comm.barrier(device)
    # one rank alone is all ranks busy: its speed is 1 by definition (a second timing of the same
    # work wrote 0.03-4.8 on a shared machine, and every plan on that file was off as much)
    together = solo if world == 1 else _time_ms(step, torch, device, 7, window_s=1.5)
    mem = _memory_bytes(torch, device, env.local_world_size)
    rows: list[object] = [None] * world
    with comm.collective("calibrate, gathering every rank's speed and memory", args.timeout):
        dist.all_gather_object(rows, (together, mem, device.type, device_name(device)))
    comm.barrier(device)

    # what a message costs inside a running pipeline (runtime.pipeline_probe)
    probe = None
    if world >= 2:
        from runtime import pipeline_probe

        say("what a message costs inside a running pipeline")
        probe = pipeline_probe.run(torch, dist, me, world, device, args.timeout,
                                   iterations=max(10, args.rounds))
        comm.barrier(device)
    dist.destroy_process_group()
    if me != 0:
        return None
    if probe is not None:
        intra, inter = _link_classes(links)
        crossed = [intra if node_of[r - 1] == node_of[r] else inter for r in range(1, world)]
        probe = pipeline_probe.priced(probe, [(lk["latency_us"], lk["gb_per_s"]) for lk in crossed])
    # the same kind of device as the profiled one: only running together slows it (the
    # profile's whole-model time sums separately timed parts, so it is no reference); another
    # kind: the profile's time of the same work against this device's
    same = profiled is None or profiled == (rows[0][2], rows[0][3])  # type: ignore[index]
    base = solo if same else ref_ms
    return {
        "profiled_device": list(profiled) if profiled else None, "same_device_as_profiled": same,
        "solo_ms": solo, "profile_measured_ms": ref_ms,
        "backend": backend, "world_size": world, "node_names": node_names,
        "ranks_of_node": ranks_of_node, "links": links, "allreduce": ar,
        "speed_workload": "profile" if args.profile else "reference MLP",
        "speed_reference_ms": base,
        "together_ms": [r[0] for r in rows],  # type: ignore[index]
        "speeds": [base / r[0] for r in rows],  # type: ignore[index,operator]
        "memory_bytes": [r[1] for r in rows],  # type: ignore[index]
        "device": rows[0][2], "device_name": rows[0][3],  # type: ignore[index]
        "pipeline": probe,
    }


# ---------------------------------------------------------------- cluster.json


def _link_classes(links: dict) -> tuple[dict, dict]:
    """(same-node, cross-node) link figures; a class not measured (one rank per node, or one
    node) takes the other's."""
    intra = links.get("intra") or links.get("inter") or {"latency_us": 0.0, "gb_per_s": 1e6}
    return intra, links.get("inter") or intra


def cluster_from(meas: dict, memory_gb: float | None = None) -> dict:
    """The cluster.json fields from rank 0's measurements (pure)."""
    nodes = meas["ranks_of_node"]
    speeds, mem = meas["speeds"], meas["memory_bytes"]
    intra, inter = _link_classes(meas["links"])
    node_speed = [round(statistics.median(speeds[r] for r in rs), 4) for rs in nodes]
    node_mem = [memory_gb if memory_gb else round(min(mem[r] for r in rs) / 1e9, 3) for rs in nodes]
    out: dict = {}
    if len({len(rs) for rs in nodes}) == 1 and len(set(node_speed)) == 1 and len(set(node_mem)) == 1 \
            or len(nodes) == 1:
        out.update(nodes=len(nodes), devices_per_node=len(nodes[0]), device_memory_gb=node_mem[0],
                   speed=node_speed[0])
    else:
        out["nodes"] = [{"name": meas["node_names"][n], "devices": len(rs),
                         "device_memory_gb": node_mem[n], "speed": node_speed[n]}
                        for n, rs in enumerate(nodes)]
    out.update(
        intra_node_gb_per_s=round(intra["gb_per_s"], 4), inter_node_gb_per_s=round(inter["gb_per_s"], 4),
        latency_us=round(min(intra["latency_us"], inter["latency_us"]), 2),
        intra_node_latency_us=round(intra["latency_us"], 2),
        inter_node_latency_us=round(inter["latency_us"], 2),
        allreduce_efficiency=round(float(meas["allreduce"].get("efficiency", 1.0)) or 1.0, 4)
        if meas.get("allreduce") else 1.0,
        p2p_overhead_us=round(float(meas["pipeline"]["p2p_overhead_us"]), 1) if meas.get("pipeline") else 0.0,
        calibration={k: meas.get(k) for k in (
            "backend", "device", "device_name", "links", "allreduce", "speed_workload",
            "speed_reference_ms", "solo_ms", "profile_measured_ms", "profiled_device",
            "same_device_as_profiled", "together_ms", "speeds", "memory_bytes", "pipeline")}
        | {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    )
    return out


def format_summary(cluster: dict, nominal: dict | None) -> str:
    cal = cluster["calibration"]
    nom = nominal or {}

    def n(key: str, fmt: str = "{:g}") -> str:
        v = nom.get(key)
        if v is None and key.endswith("_latency_us"):
            v = nom.get("latency_us")
        return fmt.format(v) if isinstance(v, int | float) else "-"

    speed = cluster.get("speed", None)
    if speed is None:
        speed = ", ".join(f"{x['name']} {x['speed']:g}" for x in cluster["nodes"])
    memory = cluster.get("device_memory_gb", None)
    if memory is None:  # the list form: per node
        memory = ", ".join(f"{x['name']} {x['device_memory_gb']:g}" for x in cluster["nodes"])
    lines = [
        f"calibrated {cal['backend']} on {len(cal['speeds'])} {cal['device']} rank(s) "
        f"({cal['device_name']})",
        f"{'':32s} {'measured':>14s} {'nominal':>10s}",
        f"{'same-node latency (us)':32s} {cluster['intra_node_latency_us']:>14.1f} {n('intra_node_latency_us'):>10s}",
        f"{'same-node bandwidth (GB/s)':32s} {cluster['intra_node_gb_per_s']:>14.3f} {n('intra_node_gb_per_s'):>10s}",
        f"{'cross-node latency (us)':32s} {cluster['inter_node_latency_us']:>14.1f} {n('inter_node_latency_us'):>10s}",
        f"{'cross-node bandwidth (GB/s)':32s} {cluster['inter_node_gb_per_s']:>14.3f} {n('inter_node_gb_per_s'):>10s}",
        f"{'all-reduce efficiency':32s} {cluster['allreduce_efficiency']:>14.3f} {n('allreduce_efficiency'):>10s}",
        f"{'per-message overhead (us)':32s} {cluster.get('p2p_overhead_us', 0.0):>14.1f} {n('p2p_overhead_us'):>10s}",
        f"{'device speed (x profiled device)':32s} {speed!s:>14s} {n('speed'):>10s}",
        f"{'memory per device (GB)':32s} {memory!s:>14s} {n('device_memory_gb'):>10s}",
    ]
    if not cal["links"]:  # one rank: no pair to measure; the file's link figures are placeholders
        lines = [x for x in lines if "latency" not in x and "bandwidth" not in x]
        lines.append("(one rank: no link measured; the file's link figures are placeholders that a "
                     "plan on one device never uses)")
    elif "inter" not in cal["links"]:
        lines.append("(one node: cross-node figures are the same-node ones)")
    lines.append("per-rank speed: " + ", ".join(f"{s:.2f}" for s in cal["speeds"]))
    probe = cal.get("pipeline")
    if probe:
        lines.append(f"pipeline probe ({len(probe['fwd_ms'])} ranks, {probe['schedule']}, "
                     f"{probe['microbatches']} microbatches): iteration {probe['iteration_ms']:.2f} ms "
                     f"measured, {probe['simulated_without_overhead_ms']:.2f} ms simulated without "
                     "the per-message overhead")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if bool(args.profile) != bool(args.model):
        print("error: --profile and --model go together (the model of the profile)", file=sys.stderr)
        return 2
    try:
        _check_args(args)
    except PipeplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from runtime.launch import ERROR_FILE_ENV, die_with_launcher

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        die_with_launcher()
        return _rank(args, os.environ.get(ERROR_FILE_ENV))
    nproc = args.nproc_per_node
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() or (os.cpu_count() or 1)
    if nproc < 1:
        print("error: --nproc-per-node must be at least 1", file=sys.stderr)
        return 2
    try:
        nominal = _load_nominal(args.nominal)
    except PipeplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    del nominal
    from runtime.launch import check_room, launch

    try:
        check_room(nproc, f"--nproc-per-node {nproc}")
    except PipeplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    if nproc > cores:
        print(f"warning: {nproc} rank processes on {cores} CPU cores; they will share the cores, "
              "and calibrate measures them that way", file=sys.stderr)

    print(f"calibrating {nproc} local rank(s) ...", flush=True)
    try:
        failures = launch(["calibrate", *argv], nproc)
    except KeyboardInterrupt as exc:
        from runtime.launch import Terminated, report_terminated

        if isinstance(exc, Terminated):
            return report_terminated(exc, ranks_stopped=True)
        print("interrupted", file=sys.stderr)
        return 130
    if failures:
        print(f"error: {failures[0].message}", file=sys.stderr)
        return 2 if failures[0].kind == "user" else 1
    return 0


MAX_LOCAL_RANKS = 1024  # one machine's ranks; more is a typo (each rank is a process)


def _check_args(args: argparse.Namespace) -> None:
    """Every option that would fail only after the ranks have measured, checked first."""
    import math

    from planner.io import check_output

    if args.nproc_per_node is not None and args.nproc_per_node > MAX_LOCAL_RANKS:
        raise PipeplanError(f"--nproc-per-node {args.nproc_per_node}: at most {MAX_LOCAL_RANKS} "
                            "ranks on one machine (one per device or core)")
    if not 1 <= args.rounds <= MAX_ROUNDS:  # (10^12 was taken, and ran until killed)
        raise PipeplanError(f"--rounds must be from 1 to {MAX_ROUNDS} (the default 60 measures "
                            "within a few percent)")
    from runtime.cli import MAX_TIMEOUT_S, MIN_TIMEOUT_S

    if not (math.isfinite(args.timeout) and MIN_TIMEOUT_S <= args.timeout <= MAX_TIMEOUT_S):
        raise PipeplanError(f"--timeout {args.timeout:g}: give a finite number of seconds, from "
                            f"{MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g}")
    from planner.formats import MAX_DEVICE_MEMORY_GB

    if args.memory_gb is not None and not (math.isfinite(args.memory_gb)
                                           and MIN_POSITIVE <= args.memory_gb <= MAX_DEVICE_MEMORY_GB):
        raise PipeplanError(f"--memory-gb {args.memory_gb:g}: give the usable memory per device in GB "
                            f"(at least {MIN_POSITIVE:g}, at most {MAX_DEVICE_MEMORY_GB:g})")
    # every rank checks its arguments; only rank 0 writes cluster.json
    check_output(args.output, (args.profile, args.model, args.nominal),
                 probe=os.environ.get("RANK", "0") == "0")
    if args.profile:
        from planner.formats import Profile
        from planner.io import load_model, not_a_file
        from profiler.loader import file_sha256

        profile = load_model(args.profile, Profile, f"profile {args.profile}")
        if not os.path.isfile(args.model):  # found by every rank after the launch, before
            raise PipeplanError(f"--model {args.model}: {not_a_file(args.model)}")
        if profile.model.sha256 != file_sha256(args.model):
            raise PipeplanError(f"--profile {args.profile} was made from another version of "
                                f"{args.model} (its sha256 differs): profile this file again")


def _load_nominal(path: str | None) -> dict | None:
    if not path:
        return None
    from planner.formats import Cluster
    from planner.io import load_model

    return load_model(path, Cluster, f"nominal cluster {path}").model_dump()


def _rank(args: argparse.Namespace, error_file: str | None) -> int:
    from runtime.launch import as_rank

    return as_rank(_rank_run, args, error_file)


def _rank_run(args: argparse.Namespace, error_file: str | None) -> int:
    from runtime.worker import DistEnv, end_rank

    env = DistEnv.from_environ()
    try:
        nominal = _load_nominal(args.nominal)
        meas = rank_main(args)
        if meas is not None:
            from planner.formats import Cluster

            data = cluster_from(meas, args.memory_gb)
            Cluster.model_validate(data)  # what we write must load, as `plan` reads it
            if (bad := small_divisor(data)) is not None:
                raise PipeplanError(f"calibrate measured {'.'.join(map(str, bad[0]))} {bad[1]}: "
                                    "nothing was written; run it again on a quieter machine")
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(args.output, json.dumps(data, indent=2) + "\n")
            print(format_summary(data, nominal), flush=True)
            print(f"wrote {args.output}", flush=True)
    except BaseException as exc:  # noqa: BLE001 - end this rank promptly, tell the launcher
        end_rank(env, exc, error_file)
    from runtime.launch import finished

    finished(error_file)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
