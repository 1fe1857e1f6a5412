"""Blocks whose forward reads state its own forwards change: a plain Python attribute
(`self.calls += 1`), a buffer changed in place (a step counter) and a tensor attribute
rebound in every forward. Plain PyTorch: each forward call moves the state once, and the
output depends on it, so a recomputation that ran on later state would train differently."""

import torch
from torch import nn


class Cycling(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.last = torch.zeros(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + 0.5 * (self.calls % 3) + 0.25 * (self.steps % 2)
        y = torch.tanh(self.lin(x) * scale) + x + 0.1 * self.last
        if torch.is_grad_enabled():
            self.calls += 1
            self.steps += 1
            self.last = y.detach().mean(0)
        return y


def build_model() -> nn.Module:
    d = 12
    return nn.Sequential(nn.Linear(4, d), Cycling(d), Cycling(d), Cycling(d), Cycling(d), nn.Linear(d, 2))


def make_batch(n: int):
    return (torch.randn(n, 4),), torch.randn(n, 2)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
