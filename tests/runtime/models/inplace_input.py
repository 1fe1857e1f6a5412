"""The first block normalises the model's input in place (`x.sub_(mean).mul_(0.5)`, preprocessing
inside the model), a middle block changes its own input in place (`h.mul_(...)` on a tensor that
needs a gradient). Recomputing a block that changes its input must run on the input as it was."""

import torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean(1, keepdim=True)).mul_(0.5)
        return torch.tanh(self.lin(x))


class Scales(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(h))
        z = h * 1.0  # its own copy, which it then changes in place
        z.add_(y)
        return z


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Norm(6), Block(), Scales(), Block())
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x)
        return self.out(h)


def build_model() -> nn.Module:
    return Net()


def make_batch(n: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return (torch.randn(n, 6) + 1.0,), torch.randn(n, 3)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)
