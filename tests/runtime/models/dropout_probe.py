"""Blocks with dropout that also record every dropout mask they draw (buffer `masks`, one row
per forward call, in call order), to check the runtime's random streams."""

import torch
from torch import nn

DIM = 256
CALLS = 16  # rows of `masks`: forward calls recorded (steps x microbatches)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("masks", torch.zeros(CALLS, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(DIM) >= 0.5).float()
        if self.training and int(self.calls) < CALLS:
            self.masks[int(self.calls)] = keep
            self.calls += 1
        return torch.tanh(self.lin(x * keep * 2))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def build_model() -> nn.Module:
    return Net()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 2)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
