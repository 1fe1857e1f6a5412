"""A user's model that checkpoints its blocks with torch.utils.checkpoint(use_reentrant=False):
its backward recomputes each block (ZB-H1 runs such a stage fused; split, W recomputes once more)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return x + self.inner(x)
        return x + checkpoint(self.inner, x, use_reentrant=False)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Block(8), Block(8), Block(8), nn.Linear(8, 3))


def make_batch(n: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 4, generator=g),), torch.randn(n, 3, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)
