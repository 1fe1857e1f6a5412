"""Encoder blocks push their inputs on a shared Python list, decoder blocks pop them (a U-Net
written with a feature stack instead of returned skips): the list holds activations."""
import torch
from torch import nn


class Enc(nn.Module):
    def __init__(self, stack):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.stack = stack

    def forward(self, x):
        self.stack.append(x)
        return torch.tanh(self.lin(x))


class Dec(nn.Module):
    def __init__(self, stack):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.stack = stack

    def forward(self, x):
        return torch.tanh(self.lin(x)) + self.stack.pop()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        stack = []
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.Sequential(Enc(stack), Enc(stack), Dec(stack), Dec(stack))
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def build_model():
    return Net()


def make_batch(n):
    return (torch.randn(n, 6),), torch.randn(n, 3)


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)
