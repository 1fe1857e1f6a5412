"""Layer names and parameters do not depend on the sequence length (PIPEPLAN_TEST_SEQ); the
activations' shapes do: a plan made at one length and run at another (an outside review)."""
import os

import torch
from torch import nn

SEQ = int(os.environ.get("PIPEPLAN_TEST_SEQ", "8"))


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(32, 32)
        self.l1 = nn.Linear(32, 32)
        self.l2 = nn.Linear(32, 32)
        self.l3 = nn.Linear(32, 32)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(torch.relu(self.l0(x)))))))


def build_model():
    return M()


def make_batch(batch_size):
    return (torch.randn(batch_size, SEQ, 32),), torch.randn(batch_size, SEQ, 32)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()
