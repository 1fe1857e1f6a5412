"""Lazy modules (`nn.LazyLinear`, `nn.LazyBatchNorm1d`): their sizes come from the first
forward, as in a training loop that makes one dry run before building the optimizer. A stage
of them must hold the same initial weights as that loop (make_batch draws from the global
random stream on purpose: the dry run must not depend on it)."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.LazyLinear(12)
        self.norm = nn.LazyBatchNorm1d()
        self.b = nn.LazyLinear(12)
        self.c = nn.Linear(12, 12)
        self.head = nn.LazyLinear(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.a(x)))
        x = torch.tanh(self.b(x))
        x = x + torch.tanh(self.c(x))
        return self.head(x)


def build_model() -> nn.Module:
    return Net()


def make_batch(n: int):
    return (torch.randn(n, 6),), torch.randn(n, 3)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
