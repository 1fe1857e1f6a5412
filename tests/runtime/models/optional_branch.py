"""Each block has a branch the step's data switches on or off for every microbatch of the
step (`flag`): in a step without it, its Linear gets no gradient at all, so single-device
training's optimizer skips it (no momentum step, Adam's moments untouched). With seeds 0..4
the branch is off in steps 0 and 3."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.extra = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.lin(x))
        if bool(flag[0] > 0.5):  # decided by the step's data
            x = x + self.extra(x)
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8) for _ in range(3)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for b in self.blocks:
            h = b(h, flag)
        return self.head(h)


def build_model() -> nn.Module:
    return Net()


def make_batch(n: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    use = float(torch.rand(()) > 0.5)
    return (torch.randn(n, 4), torch.full((n,), use)), torch.randn(n, 1)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
