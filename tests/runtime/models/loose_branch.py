"""A middle block returns `(x * g, g.expand(...))`: its weight reaches the stage's output by the
input path and, on its own, by a branch that does not depend on the input (as a T5 decoder
block returns the position bias it makes from its own embedding). ZB-H1's W must count both."""

import torch
from torch import nn


class Lin(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.l = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.l(x))
        return y if scale is None else y * scale


class Gate(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, d).unsqueeze(0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.g, self.g.expand(x.shape[0], -1)


class Net(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Lin(d), Gate(d), Lin(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        h, s = self.blocks[1](h)
        return self.blocks[2](h, scale=s)


def build_model() -> nn.Module:
    return Net()


def make_batch(batch_size: int):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 8)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()
