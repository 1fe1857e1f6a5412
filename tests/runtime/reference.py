"""Single-process training, the reference the pipeline runs must match: the same seed, the same
batches, microbatch gradient accumulation (loss / m per microbatch), one optimizer step per
iteration."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from profiler.loader import load_model_file


def reference_train(model_path: str, steps: int, *, seed: int = 0, global_batch: int = 8,
                    microbatch_size: int = 2, optimizer: str = "sgd", lr: float = 0.01,
                    dry_run: bool = False, weight_decay: float = 0.0,
                    clip_grad_norm: float | None = None,
                    lr_lambda: Callable[[int], float] | None = None,
                    norms: list[float] | None = None) -> dict[str, torch.Tensor]:
    """With `dry_run`, one forward of a microbatch in eval mode right after build_model (its
    random state kept from make_batch), as PyTorch advises before building the optimizer of
    a model with lazy modules. `weight_decay` is AdamW's with adam, SGD's otherwise;
    `clip_grad_norm` clips with torch.nn.utils.clip_grad_norm_ before each step; `lr_lambda`
    is a torch LambdaLR's factor of the step; `norms` gets clip_grad_norm_'s norm of each step."""
    mf = load_model_file(model_path)
    torch.manual_seed(seed)  # a script's seeds: the generators build_model may draw from
    random.seed(seed)
    np.random.seed(seed)
    model = mf.build_model()
    if dry_run:
        state = torch.get_rng_state()
        inputs, _ = mf.make_batch(microbatch_size)
        torch.set_rng_state(state)
        model.eval()
        with torch.no_grad():
            model(*((inputs,) if isinstance(inputs, torch.Tensor) else inputs))
        model.train()
    params = list(model.parameters())
    if optimizer == "adam":
        opt = (torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay) if weight_decay
               else torch.optim.Adam(params, lr=lr))
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9 if optimizer == "momentum" else 0.0,
                              weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    m = global_batch // microbatch_size
    for s in range(steps):
        # the generators make_batch may draw from, seeded before every step's batch
        torch.manual_seed(seed + s)
        random.seed(seed + s)
        np.random.seed(seed + s)
        inputs, target = mf.make_batch(global_batch)
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        for j in range(m):
            rows = slice(j * microbatch_size, (j + 1) * microbatch_size)
            out = model(*[x[rows] for x in inputs])
            (mf.loss_fn(out, target[rows]) / m).backward()
        if clip_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip_grad_norm))
            if norms is not None:
                norms.append(norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)
