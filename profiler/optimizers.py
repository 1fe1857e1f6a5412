"""The optimizers the runtime trains with, and the time of one optimizer step.

`make_optimizer` is the runtime's own construction (`runtime.worker` uses it), so the step the
profiler times is the step the runtime runs: `sgd` (plain SGD), `momentum` (SGD, momentum 0.9)
and `adam` (Adam), torch's defaults otherwise (for-loop on CPU, foreach on CUDA).

`step_ms(params, name, device)` times `optimizer.step()` and `optimizer.zero_grad(set_to_none=True)`,
as the runtime runs them every iteration, over copies of `params` given fresh gradients before
each step (untimed, as a backward leaves them; freeing large gradients costs time on CPU): the
model's own tensors are never touched. The first steps (warm-up) create the state
(momentum buffer, Adam's moments); the median of the rest is returned. A step's time does not
depend on the batch, so the planner adds it once per iteration, after a stage's last backward
and its all-reduce (`planner.cost`).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterable

import torch
from torch import nn

from profiler.measure import Timer

OPTIMIZERS = ("sgd", "momentum", "adam")


def make_optimizer(name: str, params: list[nn.Parameter], lr: float,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """`weight_decay` (the runtime's --weight-decay) is decoupled for `adam` (torch.optim.AdamW,
    as transformers are trained) and L2 for `sgd` and `momentum` (SGD's weight_decay, added to
    the gradient); Adam itself where it is 0."""
    if name == "adam":
        if weight_decay > 0:
            return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        return torch.optim.Adam(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")


def unique_trainable(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters that take a gradient (the optimizer steps only those), each tensor once."""
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def step_ms(params: Iterable[torch.Tensor], name: str, device: torch.device,
            warmup: int = 2, repeats: int = 5, clock: str = "wall") -> float:
    """Median milliseconds of one `name` step (and zero_grad) over copies of the trainable
    `params` (0.0 when none is trainable). The copies get small gradients, the same every step
    (Adam's state stays in the normal float range: no denormals to slow the CPU), on `device`."""
    trainable = unique_trainable(params)
    if not trainable:
        return 0.0
    gen = torch.Generator(device="cpu").manual_seed(0)
    copies, grads = [], []
    with torch.no_grad():
        for p in trainable:
            copies.append(nn.Parameter(p.detach().to(device).clone()))
            grads.append((torch.rand(p.shape, generator=gen, dtype=torch.float32) * 1e-3 + 1e-4)
                         .to(p.dtype).to(device))
    opt = make_optimizer(name, copies, lr=1e-3)
    timer = Timer(device, clock)
    times = []
    for k in range(max(warmup, 1) + repeats):  # at least one warm-up: the state's creation
        with torch.no_grad():  # fresh gradients, as a backward leaves them (untimed)
            for c, g in zip(copies, grads, strict=True):
                c.grad = g.clone()
        t = timer.start()
        opt.step()
        opt.zero_grad(set_to_none=True)  # the runtime's: freeing large gradients costs too
        ms = timer.stop(t)
        if k >= max(warmup, 1):
            times.append(ms)
    return float(statistics.median(times))


def step_ms_all(params: Iterable[torch.Tensor], device: torch.device, warmup: int = 2,
                repeats: int = 5, clock: str = "wall", label: str = "") -> dict[str, float] | None:
    """`step_ms` for every optimizer the runtime has; None, with a warning on stderr, where the
    copies (the parameters, their gradients and Adam's two moments: 4x the parameters) do not
    fit the device: the planner then prices no step for that layer."""
    ps = list(params)
    try:
        return {name: step_ms(ps, name, device, warmup, repeats, clock) for name in OPTIMIZERS}
    except (torch.cuda.OutOfMemoryError, MemoryError):
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"warning: layer {label!r}: no optimizer step measured (the copies of its parameters, "
              "gradients and optimizer state do not fit the device); the planner prices none for it",
              file=sys.stderr, flush=True)
        return None
