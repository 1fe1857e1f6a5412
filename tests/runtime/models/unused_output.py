"""A model that returns a diagnostic output besides its prediction (`aux`, from a probe head on
an early layer); the loss reads only the prediction, so in one process the probe head gets no
gradient (grad None) and the optimizer leaves it alone."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.probe = nn.Linear(16, 2)
        self.blocks = nn.Sequential(*[Block(16) for _ in range(4)])
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        aux = self.probe(h)
        return self.out(self.blocks(h)), aux


def build_model():
    return Net()


def make_batch(n):
    return (torch.randn(n, 6),), torch.randn(n, 3)


def loss_fn(out, y):
    pred, _aux = out
    return nn.functional.mse_loss(pred, y)
