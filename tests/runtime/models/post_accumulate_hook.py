"""An MLP whose blocks' weights have a post-accumulate-grad hook (the gradient scaled by 0.5
each time a backward accumulates into .grad: a stand-in for in-backward gradient processing,
such as an optimizer stepped in the backward)."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def _halve(p):
    p.grad.mul_(0.5)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.Sequential(*[Block(16) for _ in range(4)])
        self.out = nn.Linear(16, 3)
        for b in self.blocks:
            b.lin.weight.register_post_accumulate_grad_hook(_halve)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def build_model():
    return Net()


def make_batch(n):
    return (torch.randn(n, 6),), torch.randn(n, 3)


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)
