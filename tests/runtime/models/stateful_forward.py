"""Blocks whose forward reads state its own forwards change: a plain Python attribute
(`self.calls += 1`), a buffer changed in place (a step counter), a tensor attribute
rebound in every forward, and a buffer first changed in place by the third forward
(`late`, of STATEFUL_LATE_SIZE floats: 4 unless the environment says otherwise). Plain
PyTorch: each forward call moves the state once, and the output depends on it, so a
recomputation that ran on later state would train differently."""

import os

import torch
from torch import nn


class Cycling(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.last = torch.zeros(d)
        self.register_buffer("late", torch.zeros(int(os.environ.get("STATEFUL_LATE_SIZE", "4"))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + 0.5 * (self.calls % 3) + 0.25 * (self.steps % 2)
        y = torch.tanh(self.lin(x) * scale + self.late[0]) + x + 0.1 * self.last
        if torch.is_grad_enabled():
            if self.calls >= 2:
                self.late.add_(0.3)
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
