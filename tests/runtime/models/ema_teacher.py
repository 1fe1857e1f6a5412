"""An EMA (momentum) teacher updated in place inside a block's forward, under no_grad: a frozen
nn.Linear whose weight the gradient's path through its input makes autograd save. One process
trains it; a pipeline runs later microbatches' forwards before this one's backward. From an
outside review. PIPEPLAN_EMA_THROUGH_DATA=1 moves the teacher through `.data`."""
import os

import torch
from torch import nn

THROUGH_DATA = os.environ.get("PIPEPLAN_EMA_THROUGH_DATA") == "1"


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.student = nn.Linear(d, d)
        self.teacher = nn.Linear(d, d)
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for pt, ps in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
                if THROUGH_DATA:  # (moves no version: runtime.later_forward's fingerprints)
                    pt.data.mul_(0.9).add_(ps.data, alpha=0.1)
                else:
                    pt.mul_(0.9).add_(ps, alpha=0.1)
        return x + torch.tanh(self.student(x)) * torch.sigmoid(self.teacher(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Block(8) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return Net()


def make_batch(n):
    return (torch.randn(n, 6),), torch.randn(n, 3)


def loss_fn(o, y):
    return nn.functional.mse_loss(o, y)
