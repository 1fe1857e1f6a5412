"""Blocks whose forward reads and moves state of kinds a recomputation must put back as the
first forward found it: a registered buffer rebound (not changed in place) every call, a large
buffer rebound every other call, a list appended to and a dict updated, and generators of the
block's own (torch's, Python's random.Random, numpy's). Plain PyTorch: each forward call moves
the state once, and the output depends on it."""

import random

import numpy as np
import torch
from torch import nn

D = 8


class Block(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("scale", torch.ones(D))
        self.register_buffer("queue", torch.zeros(32 * 1024))  # 128 kB: copied only when needed
        self.hist: list[float] = []
        self.stats = {"n": 0}
        self.gen = torch.Generator().manual_seed(100 + i)
        self.py = random.Random(200 + i)
        self.np = np.random.default_rng(300 + i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = 1 + 0.5 * torch.rand(x.shape, generator=self.gen)
        s = 1.0 + 0.1 * len(self.hist) + 0.05 * self.stats["n"] + 0.1 * self.py.random() \
            + 0.1 * float(self.np.random())
        y = torch.tanh(self.lin(x)) * self.scale * noise * s + self.queue[:D]
        if self.training and torch.is_grad_enabled():
            self.scale = self.scale * 1.1
            self.hist.append(float(x.detach().abs().mean()))
            self.stats["n"] += 1
            if self.stats["n"] % 2 == 0:
                self.queue = self.queue + 0.05
        return x + y


def build_model() -> nn.Module:
    return nn.Sequential(*[Block(i) for i in range(4)])


def make_batch(n: int):
    return (torch.randn(n, D),), torch.randn(n, D)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
