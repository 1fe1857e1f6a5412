"""A memory-saving custom autograd.Function whose backward writes the input's gradient into a
tensor it saved (legal in PyTorch, where a backward runs once; a second pass over its node, as
W after B runs it, finds the tensor changed). From an outside review."""
import torch
import torch.nn.functional as F
from torch import nn


class ScaleInplaceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x.clone(), w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = (g * x).sum(0)
        return x.copy_(g).mul_(w), gw  # the saved buffer reused for the input's gradient


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x + ScaleInplaceBackward.apply(torch.tanh(self.fc(x)), self.w)


class Plain(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.blocks = nn.ModuleList([Plain(12), Block(12), Plain(12), Plain(12)])
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return Net()


def make_batch(n):
    return (torch.randn(n, 6),), torch.randint(0, 3, (n,))


def loss_fn(o, y):
    return F.cross_entropy(o, y)
