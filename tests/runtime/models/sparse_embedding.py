"""An embedding with sparse gradients (`nn.Embedding(sparse=True)`): SGD and momentum update
only the rows a step used; Adam refuses sparse gradients."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, sparse=True)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).mean(1)
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.b(x))
        return self.out(x)


def build_model() -> nn.Module:
    return Net()


def make_batch(n: int):
    return (torch.randint(0, 50, (n, 5)),), torch.randn(n, 3)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
