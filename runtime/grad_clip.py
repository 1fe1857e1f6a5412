"""`--clip-grad-norm MAX`: the whole model's gradient norm, over every stage, clipped as
`torch.nn.utils.clip_grad_norm_(model.parameters(), MAX)` clips it in one process.

Internal module. After the replicas' (and tied parameters') gradients are summed, every rank
adds the squares of the gradients it counts and one all-reduce over all ranks gives the
model's total. Each gradient is counted once: by the first replica of its stage only (the
others hold the same sum), for a tied parameter by the first stage that holds it only (every
holder has the summed gradient), and on a tensor-parallel stage each rank's shard of a sharded
gradient and a replicated one on the first TP rank only (by the gradient's own placement:
RowwiseParallel's embedding has a sharded weight whose gradient is whole on every TP rank; a
partial one is summed over the TP group first). Then, as torch does, every gradient
is multiplied by min(1, MAX / (norm + 1e-6)).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from runtime import tensor_parallel


def _counted_part(grad: torch.Tensor, first_tp_rank: bool) -> torch.Tensor | None:
    """The part of `grad` this rank counts: all of a plain tensor's or a replicated DTensor's
    on the first TP rank, this rank's shard of a sharded one (None: counted elsewhere)."""
    placements = getattr(grad, "placements", None)  # a DTensor's
    if placements is None:
        return grad if first_tp_rank else None
    if any(pl.is_partial() for pl in placements):  # (every TP rank takes part)
        from torch.distributed.tensor import Replicate

        grad = grad.redistribute(grad.device_mesh, [Replicate()] * len(placements))  # type: ignore[attr-defined]
        placements = grad.placements  # type: ignore[attr-defined]
    if any(pl.is_shard() for pl in placements) or first_tp_rank:
        return tensor_parallel.local(grad)
    return None


def squared_sum(params: Iterable[torch.Tensor], first_replica: bool, first_tp_rank: bool,
                skip: set[int]) -> float:
    """The sum of the squared gradients this rank counts (see the module's docstring); the
    parameters in `skip` (by id) are counted by another stage."""
    if not first_replica:
        return 0.0
    total = 0.0
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        g = _counted_part(p.grad, first_tp_rank)
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce().values()
        total += float(g.detach().double().pow(2).sum())
    return total


def clip(params: Iterable[torch.Tensor], mine: float, max_norm: float, device: torch.device,
         wait: object) -> float:
    """All-reduce `mine` over every rank and scale this rank's gradients; returns the model's
    gradient norm before clipping. `wait(work, what)` waits for the all-reduce within the
    run's timeout."""
    t = torch.tensor([mine], dtype=torch.float64, device=device)
    wait(dist.all_reduce(t, async_op=True), "the model's gradient norm (--clip-grad-norm)")  # type: ignore[operator]
    norm = float(t.sqrt())
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0 or norm != norm:  # (a nan norm makes the gradients nan, as torch's does)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    tensor_parallel.local(p.grad).mul_(coef if norm == norm else float("nan"))
    return norm
