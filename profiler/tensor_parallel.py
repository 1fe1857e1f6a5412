"""Profile tensor-parallel degrees: every layer as it runs on one of t devices.

For each degree t the model is built again, traced into the same layers as the profile, and
each layer's stage module is sharded with the model's TP plan (`runtime.tensor_parallel`, i.e.
torch's `parallelize_module`) over a t-rank mesh of a *fake* process group: this process plays
rank 0, the modules hold real shard-sized weights and the forward/backward times are real
measurements of the shard's work (not the unsharded time divided by t). Collectives are not
run (the fake group answers at once); they are counted instead: the bytes of every TP
collective a layer issues per profiled batch, in forward and in backward, as all-reduce
equivalents (an all-gather or reduce-scatter of n output bytes counts n/2, as a ring moves half
as much for it as for an all-reduce of n). The cost model prices those bytes on the node's
links (ARCHITECTURE.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from planner.errors import PipeplanError
from planner.formats import LayerTP
from profiler.graph import build_stage, trace
from profiler.measure import count_saved_bytes, layer_values

_FULL = ("all_reduce", "allreduce_")
_HALF = ("all_gather_into_tensor", "reduce_scatter_tensor", "allgather_", "reduce_scatter_")


class _CommBytes(TorchDispatchMode):
    """Counts the all-reduce-equivalent bytes of the collectives dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in _FULL or name in _HALF:
            first = next((t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)), None)
            if first is not None:
                n = first.numel() * first.element_size()
                if name in ("all_gather_into_tensor", "allgather_"):
                    n *= dist.get_world_size()  # the gathered output
                self.nbytes += n if name in _FULL else n // 2
                self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def fake_group(world_size: int) -> Iterator[Any]:
    """A process group of `world_size` ranks in which this process is rank 0 and collectives
    do nothing; yields a 1-D device mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise PipeplanError("profiling tensor-parallel degrees needs a process without torch.distributed")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    from runtime.tensor_parallel import local

    return local(t)


def measure_degree(build: Callable[[], torch.nn.Module], inputs: tuple[torch.Tensor, ...],
                   granularity: str, plan_of: Callable[[torch.nn.Module], dict[str, str]],
                   degree: int, warmup: int = 2, repeats: int = 5, clock: str = "wall"
                   ) -> list[LayerTP]:
    """Every layer sharded over `degree` ranks (see the module docstring); `clock` "thread"
    times with this thread's CPU time (robust on a busy machine, with one torch thread)."""
    now = time.thread_time if clock == "thread" else time.perf_counter
    from runtime.tensor_parallel import parallelize

    model = build()  # in the modes build_model left, as the runtime trains it
    lg = trace(model, inputs, granularity=granularity)
    values = layer_values(lg, inputs)
    plan = plan_of(model)
    out: list[LayerTP] = []
    with fake_group(degree) as mesh:
        for name in lg.layer_names():
            stage = build_stage(lg, [name])
            parallelize(stage, plan, mesh)
            state = [_local(t.detach()) for t in list(stage.parameters()) + list(stage.buffers())]
            params = sum(_local(p.detach()).numel() * p.element_size() for p in stage.parameters())
            fwd, bwd, saved, comm_f, comm_b, n_f, n_b = [], [], 0, 0, 0, 0, 0
            for i in range(warmup + repeats):
                feed = {k: (v.detach().clone().requires_grad_(v.is_floating_point())
                            if isinstance(v, torch.Tensor) else v)
                        for k, v in ((k, values[k]) for k in stage.input_keys)}
                cf, cb = _CommBytes(), _CommBytes()
                t0 = now()
                with count_saved_bytes(state) as seen, cf:
                    res = stage(feed)
                t1 = now()
                outs = [t for t in pytree.tree_leaves(res)
                        if isinstance(t, torch.Tensor) and t.requires_grad]
                t2 = now()
                if outs:
                    with cb:
                        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                t3 = now()
                stage.zero_grad(set_to_none=True)
                if i >= warmup:
                    fwd.append((t1 - t0) * 1e3)
                    bwd.append((t3 - t2) * 1e3)
                saved, comm_f, comm_b = sum(seen.values()), cf.nbytes, cb.nbytes
                n_f, n_b = cf.count, cb.count
            out.append(LayerTP(degree=degree, fwd_ms=statistics.median(fwd),
                               bwd_ms=statistics.median(bwd), param_bytes=params,
                               activation_bytes=saved, allreduce_bytes_fwd=comm_f,
                               allreduce_bytes_bwd=comm_b, allreduces_fwd=n_f,
                               allreduces_bwd=n_b))
    return out
