"""A model body that torch.fx cannot trace (a branch on a shape, as Hugging Face models have)
inside a wrapper of the user's own, which passes a mask as a keyword: torch.export keeps the
body's blocks as calls, so stages start at them."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, mask):
        return x + torch.tanh(self.lin(x)) * mask


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x, mask=None):
        if x.shape[-1] != 4:
            raise ValueError("four features")
        if mask is None:
            mask = torch.ones_like(x[:, :1])
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, mask)
        return h


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(8, 2)

    def forward(self, x, mask):
        return self.head(self.body(x, mask=mask))


def build_model():
    torch.manual_seed(0)
    return Wrapper()


def make_batch(n):
    return (torch.randn(n, 4), (torch.arange(n) % 2).float()[:, None]), torch.randn(n, 2)


def loss_fn(out, y):
    return ((out - y) ** 2).mean()
