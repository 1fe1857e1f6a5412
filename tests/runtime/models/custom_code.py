"""Blocks whose code a trace cannot reproduce: a straight-through estimator and a gradient
reversal (custom autograd Functions: their backward is not the derivative of their forward),
forward hooks that change a block's output, a hook that scales a tensor's gradient, a step counter and a running mean updated in place
in forward. A pipeline that re-traced the blocks instead of calling them would train differently.
With PIPEPLAN_CALL_LOG=<file>, every block forward appends "<RANK> <grad enabled>" to the file.
"""

import os

import torch
from torch import nn


class RoundSTE(torch.autograd.Function):
    """Forward rounds to a grid of 1/4; backward passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad


class ReverseGrad(torch.autograd.Function):
    """Identity forward, negated (and halved) gradient backward."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return -0.5 * grad


class Block(nn.Module):
    def __init__(self, dim: int, reverse: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.reverse = reverse
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("PIPEPLAN_CALL_LOG"):
            with open(os.environ["PIPEPLAN_CALL_LOG"], "a") as f:
                f.write(f"{os.environ.get('RANK', '-')} {int(torch.is_grad_enabled())}\n")
        self.calls += 1
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        z = self.lin(x)
        if z.requires_grad:  # a hook on a tensor: ZB-H1's W must not apply it a second time
            z.register_hook(lambda g: g * 0.5)
        h = RoundSTE.apply(z)
        if self.reverse:
            h = ReverseGrad.apply(h)
        return x + torch.tanh(h)


def _scale_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 0.75


class Net(nn.Module):
    def __init__(self, dim: int = 16, blocks: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim, reverse=i % 2 == 1) for i in range(blocks))
        for b in self.blocks:
            b.register_forward_hook(_scale_output)
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def build_model() -> nn.Module:
    return Net()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
