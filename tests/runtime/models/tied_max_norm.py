"""An embedding with max_norm (its forward renormalises the rows it reads, in place) tied to the
head: cut between them, each stage would train its own copy and only the embedding's would be
renormalised (9.5 apart from one process after 3 steps, silently, before the runtime refused it)."""

import torch
from torch import nn

V, D, T = 20, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, max_norm=1.0)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            self.emb.weight.mul_(3.0)  # rows above max_norm: the forward changes them

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Net()


def make_batch(n: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return (torch.randint(0, V, (n, T)),), torch.randint(0, V, (n, T))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))
