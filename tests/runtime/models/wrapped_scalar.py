"""A body fx cannot trace inside a wrapper, which passes a Python number to each block:
torch.export records the blocks' calls without it (the check refuses that graph), so the body
stays one layer; the launcher's ranks must trace the same way without running that check."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        return x + torch.tanh(self.lin(x)) * scale


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x, scale=1.0):
        if x.shape[-1] != 4:
            raise ValueError("four features")
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, scale=scale)
        return h


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x, scale=0.5))


def build_model():
    torch.manual_seed(0)
    return Wrapper()


def make_batch(n):
    return (torch.randn(n, 4),), torch.randn(n, 2)


def loss_fn(out, y):
    return ((out - y) ** 2).mean()
