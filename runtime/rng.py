"""Random numbers and buffers of a pipeline run: what the runtime guarantees.

Random numbers. Single-device training draws every random number (dropout masks, noise) from one
generator in one sequence; a pipeline runs the same forwards on different processes in a
different order, so it cannot reproduce that sequence, and trained weights of a model that draws
random numbers in its forward are *not* equal to single-device training's. What the runtime
guarantees instead: the forward of microbatch `j` of step `t` on stage `s` starts from its own
generator state, seeded by `(seed, t, s, j)` (`stream_seed`). So
- masks are independent across stages and microbatches (and so across replicas, which run
  different microbatches);
- they do not depend on the number of replicas, the schedule or the order actions run in: the
  same stages and seed give the same weights, run after run (up to the summation order of
  replicated gradients);
- `--resume` continues the same streams (they depend only on the step number);
- a recomputed forward (`torch.utils.checkpoint`) sees the same numbers (it restores the state).
The batch itself is `make_batch(global_batch)`, called once per step on every rank right after
torch's, Python's `random` and numpy's global generators are seeded with `seed + t`
(`seed_batch`), as in single-device training, so the data are equal whichever of them
make_batch draws from; the first step's batch is drawn in setup (its first microbatch traces
the model), so make_batch runs exactly once per step, in order, and a make_batch that keeps a
position (a dataset walked in order) gives every rank, and single-device training, the same
rows. At the first step the ranks compare a digest of their batch (`batch_digest`) and stop
with an error if they differ (a make_batch that reads a per-process state). `build_model` runs
after the same generators are seeded with `seed` (`seed_build`), and the ranks compare a digest
of the model they built (`model_digest`) at the same time: a build_model drawing from a
generator of its own gave replicas other starting weights, which training never evened out.

Buffers of replicated stages (BatchNorm running statistics, counters). Replica k runs only its
own microbatches, so its buffers drift from the other replicas'. After every optimizer step the
runtime makes them equal again within the stage (`sync_buffers`): floating-point buffers are
*averaged* over the replicas (running means and variances: the mean of the replicas' estimates,
not single-device training's value); integer buffers advance by the *sum* of every replica's
increments in the step (BatchNorm's `num_batches_tracked`, step counters: equal to
single-device training's and equal on every stage); boolean and complex buffers are broadcast
from replica 0. Every checkpoint is therefore consistent across stages and replicas. With one replica per
stage nothing is synchronised: every stage runs every microbatch in order, so buffers equal
single-device training's exactly. (The reference is single-device training over the same
microbatches, as with gradient accumulation: BatchNorm normalises each microbatch with its own
statistics and updates its running statistics once per microbatch. torchgpipe's
`DeferredBatchNorm`, which accumulates statistics over a whole mini-batch, is not provided.)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


def seed_build(seed: int) -> None:
    """Seed the global generators a `build_model` may draw its initial weights from: torch's,
    Python's `random` and numpy's legacy global one, each with `seed`. The same on every rank:
    a build_model that drew from numpy (`np.random.randn` into a weight) gave each replica of a
    stage other initial weights, which the averaged gradients then kept apart for the whole run."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def seed_batch(seed: int, step: int) -> None:
    """Seed the global generators a `make_batch` may draw from, before step `step`'s batch:
    torch's (`torch.manual_seed`), Python's `random` and numpy's legacy global one
    (`np.random.rand`, ...), each with `seed + step`. The same on every rank: a make_batch
    drawing from numpy gave each rank other rows (the last stage's targets were not the first
    stage's inputs' and training did not converge, silently)."""
    seed_build(seed + step)


def tensors_digest(tensors: Iterable[torch.Tensor]) -> int:
    """A 63-bit digest of tensors (dtypes, shapes and bytes, in order): equal on every rank
    exactly where the tensors are."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        t = t.detach().to("cpu")
        t = (t.to_dense() if t.layout != torch.strided else t).contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def batch_digest(batch: tuple[tuple[torch.Tensor, ...], torch.Tensor]) -> int:
    """A digest of a batch's inputs and target: equal on every rank exactly where the batches are."""
    inputs, target = batch
    return tensors_digest((*inputs, target))


def structure_digest(model: nn.Module) -> int:
    """A digest of a model's parameters' and buffers' names, shapes and dtypes (not their
    values): equal on every rank exactly where they built the same architecture."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted((*model.named_parameters(), *model.named_buffers()), key=lambda x: x[0]):
        h.update(f"{name}:{t.dtype}{tuple(t.shape)};".encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def model_digest(model: nn.Module) -> int:
    """A digest of a model's parameters as built (or resumed): every rank builds the whole model,
    so it is equal on every rank exactly where their weights are. Not its buffers: one made with
    `torch.empty` as scratch space (a cache a forward fills) holds whatever memory it got."""
    return tensors_digest(p for _, p in sorted(model.named_parameters()))


def stream_seed(seed: int, step: int, stage: int, microbatch: int) -> int:
    """The generator seed of one forward: a hash of its coordinates (independent streams)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{stage}/{microbatch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_forward(seed: int, step: int, stage: int, microbatch: int) -> None:
    """Seed torch's generators (CPU and every CUDA device) for this forward.

    Not `torch.manual_seed`: it also queues a lazy seed for every accelerator backend that is
    not initialised (CUDA, XPU, MTIA), each with a formatted Python stack, ~70 us per call on
    a CPU rank, on the critical path of every forward. The CUDA generators are seeded where
    CUDA is available (a rank that runs on CPU there still gets them seeded, lazily)."""
    s = stream_seed(seed, step, stage, microbatch)
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(s)


def int_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the integer buffers (their value at the start of a step)."""
    return {k: b.detach().clone() for k, b in module.named_buffers()
            if not b.is_floating_point() and not b.is_complex() and b.dtype != torch.bool}


def sync_buffers(module: nn.Module, at_step_start: dict[str, torch.Tensor], replicas: int,
                 group: object, first_rank: int) -> None:
    """Make the buffers of a stage's replicas equal (see the module docstring)."""
    buffers = dict(module.named_buffers())
    if not buffers:
        return
    floats = [b for b in buffers.values() if b.is_floating_point()]
    if floats:
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in floats])
        dist.all_reduce(flat, group=group)
        flat /= replicas
        i = 0
        with torch.no_grad():
            for b in floats:
                b.copy_(flat[i:i + b.numel()].view_as(b).to(b.dtype))
                i += b.numel()
    ints = [(k, b) for k, b in buffers.items() if k in at_step_start]
    if ints:
        delta = torch.cat([(b.detach() - at_step_start[k]).reshape(-1).to(torch.int64) for k, b in ints])
        dist.all_reduce(delta, group=group)
        i = 0
        with torch.no_grad():
            for k, b in ints:
                b.copy_((at_step_start[k].reshape(-1).to(torch.int64) + delta[i:i + b.numel()])
                        .view_as(b).to(b.dtype))
                i += b.numel()
    for b in buffers.values():
        if b.dtype == torch.bool or b.is_complex():
            dist.broadcast(b, src=first_rank, group=group)
