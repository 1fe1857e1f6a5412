"""Conv + GroupNorm blocks in channels_last memory format (model and inputs), as in U-Nets and
diffusion models: torch 2.13's GroupNorm backward segfaults on such an input when asked for the
weight's gradient without the input's, which ZB-H1's W asked of it (a rank killed by signal 11)."""

import torch
from torch import nn

C = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(C, C, 3, padding=1)
        self.n = nn.GroupNorm(2, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.n(self.c(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.head = nn.Linear(C, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def build_model() -> nn.Module:
    return Net().to(memory_format=torch.channels_last)


def make_batch(batch_size: int):
    x = torch.randn(batch_size, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    return (x,), torch.randn(batch_size, 4)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()
