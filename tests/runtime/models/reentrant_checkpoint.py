"""A user's model that checkpoints its blocks with torch.utils.checkpoint(use_reentrant=True),
which refuses torch.autograd.grad (ZB-H1's B and W apart, the profiler's B / W timing)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    reentrant = True  # (user_checkpoint.py: the same model, non-reentrant)

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return x + self.inner(x)
        return x + checkpoint(self.inner, x, use_reentrant=self.reentrant)


def build_model(block: type[Block] = Block) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), block(8), block(8), block(8), nn.Linear(8, 3))


def make_batch(n: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 4, generator=g),), torch.randn(n, 3, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)
