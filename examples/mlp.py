"""A stack of uniform MLP blocks (pre-norm residual) on random regression data.

Sizes from the environment: PIPEPLAN_MLP_BLOCKS (8), PIPEPLAN_MLP_DIM (256),
PIPEPLAN_MLP_IN (64), PIPEPLAN_MLP_OUT (16). No dropout: training is deterministic.
"""

import os

import torch
from torch import nn

BLOCKS = int(os.environ.get("PIPEPLAN_MLP_BLOCKS", "8"))
DIM = int(os.environ.get("PIPEPLAN_MLP_DIM", "256"))
IN = int(os.environ.get("PIPEPLAN_MLP_IN", "64"))
OUT = int(os.environ.get("PIPEPLAN_MLP_OUT", "16"))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, D)
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(IN, DIM)
        self.blocks = nn.Sequential(*[Block(DIM) for _ in range(BLOCKS)])
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, IN) -> (B, OUT)
        return self.head(self.blocks(self.proj_in(x)))


def build_model() -> nn.Module:
    return MLP()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    x = torch.randn(batch_size, IN)
    return (x,), torch.randn(batch_size, OUT)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)
