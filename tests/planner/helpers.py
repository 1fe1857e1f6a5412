"""Small builders shared by the planner tests (plain data, no mocks)."""

from __future__ import annotations

import random

from planner.cost import PipelineCosts, Send
from planner.formats import INPUT_NODE, Cluster, Profile


def equal_costs(num_stages: int, num_microbatches: int, fwd_ms: float = 1.0, bwd_ms: float = 2.0,
                replicas: int = 1, act_bytes: float = 10.0, send_ms: float = 0.0) -> PipelineCosts:
    """Equal stages; ranks numbered stage by stage; free communication unless send_ms."""
    devs = tuple(tuple(range(s * replicas, (s + 1) * replicas)) for s in range(num_stages))
    S = num_stages
    return PipelineCosts(
        stage_devices=devs, num_microbatches=num_microbatches,
        fwd_ms=(fwd_ms,) * S, bwd_ms=(bwd_ms,) * S, allreduce_ms=(0.0,) * S,
        static_memory_bytes=(100.0,) * S, activation_bytes_per_microbatch=(act_bytes,) * S,
        memory_limit_bytes=(1e12,) * S,
        sends={(s - 1, s): Send(1.0, send_ms) for s in range(1, S)},
    )


def chain_profile(fwd: list[float], bwd: list[float] | None = None, params: list[int] | None = None,
                  act: list[int] | None = None, out: list[int] | None = None, batch_size: int = 8,
                  skips: list[tuple[int, int]] = ()) -> Profile:
    """A chain of layers l0..l{n-1} with the input into l0, plus optional skip edges (i -> k)."""
    n = len(fwd)
    bwd = bwd if bwd is not None else [2 * f for f in fwd]
    params = params if params is not None else [1000] * n
    act = act if act is not None else [100] * n
    out = out if out is not None else [50] * n
    layers = [{"name": f"l{i}", "fwd_ms": fwd[i], "bwd_ms": bwd[i], "param_bytes": params[i],
               "activation_bytes": act[i], "output_bytes": out[i]} for i in range(n)]
    edges = [{"src": INPUT_NODE, "dst": "l0", "bytes": 8}]
    edges += [{"src": f"l{i}", "dst": f"l{i + 1}", "bytes": out[i]} for i in range(n - 1)]
    edges += [{"src": f"l{i}", "dst": f"l{k}", "bytes": out[i]} for i, k in skips]
    return Profile.model_validate({
        "model": {"path": "m.py", "sha256": "0" * 64}, "device": {"type": "cpu", "name": "cpu"},
        "batch_size": batch_size, "layers": layers, "edges": edges,
    })


def cluster(nodes: int = 1, per_node: int = 4, memory_gb: float = 16.0, intra: float = 100.0,
            inter: float = 10.0, latency_us: float = 0.0) -> Cluster:
    return Cluster(nodes=nodes, devices_per_node=per_node, device_memory_gb=memory_gb,
                   intra_node_gb_per_s=intra, inter_node_gb_per_s=inter, latency_us=latency_us)


def synthetic_chain(num_layers: int, seed: int) -> Profile:
    """benchmarks/plan_quality.py's synthetic chains (uneven layers: 0.05-0.35 ms, 2-20 MB of
    parameters), built here so no test imports a benchmark script."""
    rng = random.Random(seed)
    layers = [dict(name=f"layer{i}", fwd_ms=rng.uniform(0.05, 0.15), bwd_ms=rng.uniform(0.1, 0.2),
                   param_bytes=int(rng.uniform(2e6, 2e7)), activation_bytes=int(rng.uniform(1e7, 4e7)),
                   output_bytes=int(4e6)) for i in range(num_layers)]
    return Profile(model={"path": f"synthetic-chain-{num_layers}", "sha256": "0"},
                   device={"type": "gpu", "name": "synthetic"}, batch_size=4, layers=layers)
