"""A MoCo-style momentum encoder: frozen parameters (`requires_grad=False`) that each block's
forward moves towards the trained ones under no_grad — through `.data` in place (invisible to
autograd's version counters) by default, with `torch.no_grad(): p.mul_()` when
PIPEPLAN_MOMENTUM_INPLACE=version. PIPEPLAN_MOMENTUM_DIM sets the width (16: tensors under
64 kB; 160: larger)."""

import os

import torch
from torch import nn

D = int(os.environ.get("PIPEPLAN_MOMENTUM_DIM", "16"))
VERSIONED = os.environ.get("PIPEPLAN_MOMENTUM_INPLACE", "data") == "version"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        for pk in self.k.parameters():
            pk.requires_grad = False  # (not a copy of q: the first forward moves k already)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters(), strict=True):
                if VERSIONED:
                    pk.mul_(0.9).add_(pq, alpha=0.1)
                else:
                    pk.data.mul_(0.9).add_(pq.data, alpha=0.1)
            key = torch.tanh(self.k(x))
        return x + torch.tanh(self.q(x)) * key


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.Sequential(*[Block() for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def build_model() -> nn.Module:
    return Net()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)
