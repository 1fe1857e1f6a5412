"""Blocks that scale by a number drawn from Python's `random` and add numpy noise in forward:
a recomputed block must draw what its first forward drew."""

import random

import numpy as np
import torch
from torch import nn

D = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = random.uniform(0.5, 1.5) if self.training else 1.0
        noise = torch.from_numpy(np.random.standard_normal(D).astype(np.float32)) * 0.1
        return x + torch.tanh(self.fc(x) * s + noise)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Model()


def make_batch(n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(n, D),), torch.randn(n, 2)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
