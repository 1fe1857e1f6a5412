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
is multiplied by min(1, MAX / (norm + 1e-6)), computed in the gradients' dtype (with bfloat16
parameters the factor is a bfloat16 number, as in one process).
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


DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the flags' order


def squared_sum(params: Iterable[torch.Tensor], first_replica: bool, first_tp_rank: bool,
                skip: set[int], device: torch.device) -> torch.Tensor:
    """[the sum of the squared norms of the gradients this rank counts (see the module's
    docstring), each norm taken in its gradient's dtype as `clip_grad_norm_` takes it; then a
    flag per dtype in DTYPES, 1 where a counted gradient has it], float64 on `device`, summed
    there (no read back to the host per parameter). The parameters in `skip` (by id) are
    counted by another stage."""
    norms: list[torch.Tensor] = []
    present = [0.0] * len(DTYPES)
    for p in params if first_replica else ():
        if p.grad is None or id(p) in skip:
            continue
        g = _counted_part(p.grad, first_tp_rank)
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce().values()
        norms.append(torch.linalg.vector_norm(g.detach(), 2).double())
        if g.dtype in DTYPES:
            present[DTYPES.index(g.dtype)] = 1.0
    total = torch.stack(norms).pow(2).sum().view(1) if norms else \
        torch.zeros(1, dtype=torch.float64, device=device)
    return torch.cat([total.to(device), torch.tensor(present, dtype=torch.float64, device=device)])


def clip(params: Iterable[torch.Tensor], mine: torch.Tensor, max_norm: float, wait: object) -> float:
    """All-reduce `mine` (`squared_sum`'s) over every rank and scale this rank's gradients;
    returns the model's gradient norm before clipping. As `clip_grad_norm_`, the total and the
    factor are computed in the gradients' dtype (their promotion: bfloat16 where every one is),
    and every gradient is multiplied by that factor. `wait(work, what)` waits for the
    all-reduce within the run's timeout."""
    wait(dist.all_reduce(mine, async_op=True), "the model's gradient norm (--clip-grad-norm)")  # type: ignore[operator]
    flags = mine[1:].tolist()
    dtype = torch.float32
    found = [d for d, f in zip(DTYPES, flags, strict=True) if f > 0]
    if found:
        dtype = found[0]
        for d in found[1:]:
            dtype = torch.promote_types(dtype, d)
    total = mine[0].sqrt().to(dtype)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():  # (times 1.0 where under the limit: exact; a nan norm makes them nan)
        for p in params:
            if p.grad is not None:
                tensor_parallel.local(p.grad).mul_(coef)
    return float(total)
