"""Many small layers: each block is one linear map, a GELU and a residual add (or, with
PIPEPLAN_SMALL_KIND=scale, one elementwise scale and tanh), a few tens of µs of work (forward +
backward) at the default sizes, so fixed per-call costs matter. Sizes from the environment:
PIPEPLAN_SMALL_BLOCKS (48), PIPEPLAN_SMALL_DIM (32)."""

import os

import torch
from torch import nn

BLOCKS = int(os.environ.get("PIPEPLAN_SMALL_BLOCKS", "48"))
DIM = int(os.environ.get("PIPEPLAN_SMALL_DIM", "32"))
KIND = os.environ.get("PIPEPLAN_SMALL_KIND", "linear")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.lin(x))


class Scale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x * self.w)


class SmallLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        kind = Scale if KIND == "scale" else Block
        self.blocks = nn.Sequential(*(kind(DIM) for _ in range(BLOCKS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def build_model() -> nn.Module:
    return SmallLayers()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, DIM),), torch.randn(batch_size, DIM)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
