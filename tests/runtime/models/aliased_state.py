"""Blocks whose plain Python containers hold their own parameters and buffers: a block mixing
two weight matrices it lists (`self.experts = [self.w0, self.w1]`), a buffer counted through a
list alias, and residual LSTMs (`RNNBase._flat_weights` lists the LSTM's parameters). Putting a
block's state back after the trace (or a recomputation) must keep those very objects in the
lists: copies left the forward reading weights the optimizer never moved (an outside review)."""

import torch
import torch.nn.functional as F
from torch import nn

D = 8


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w0 = nn.Parameter(torch.randn(D, D) * 0.3)
        self.w1 = nn.Parameter(torch.randn(D, D) * 0.3)
        self.experts = [self.w0, self.w1]
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.counters = [self.count]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c in self.counters:
            c.add_(1)
        return x + sum(torch.tanh(x @ w) for w in self.experts)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(D, D, batch_first=True)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.counters = {"calls": self.count}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counters["calls"].add_(1)
        return x + self.rnn(x)[0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.blocks = nn.ModuleList([Experts(), Experts(), Recurrent(), Recurrent()])
        self.out = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def build_model() -> nn.Module:
    return Net()


def make_batch(batch_size: int):
    return (torch.randn(batch_size, 5, 4),), torch.randn(batch_size, 5, 2)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)
