"""A loss with state, as DINO's centring: the loss subtracts a running centre of the outputs
(an EMA kept by the loss object, updated under no_grad on every call)."""
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
        self.blocks = nn.Sequential(*[Block(16) for _ in range(4)])
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


class CenteredLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("center", torch.zeros(3))

    def forward(self, out, y):
        loss = nn.functional.mse_loss(out - self.center, y)
        with torch.no_grad():
            self.center.mul_(0.5).add_(0.5 * out.mean(0))
        return loss


def build_model():
    return Net()


def make_batch(n):
    return (torch.randn(n, 6),), torch.randn(n, 3) + 2.0


loss_fn = CenteredLoss()
