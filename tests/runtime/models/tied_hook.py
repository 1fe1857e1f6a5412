"""A tied embedding and head with a gradient hook on the shared weight (a clamp: not linear), so
stages holding the embedding and the head each see a part of its gradient."""

import torch
from torch import nn

V, D, T = 20, 16, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        self.emb.weight.register_hook(lambda g: g.clamp(-0.02, 0.02))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(ids)))


def build_model() -> nn.Module:
    return Net()


def make_batch(n: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    ids = torch.randint(0, V, (n, T))
    return (ids,), torch.randint(0, V, (n, T))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))
