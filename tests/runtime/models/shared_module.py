"""One nn.Linear called at the start and at the end of the model, a top-level parameter used
at both ends, and a BatchNorm in every block: on 3 stages the first and the last stage each
hold the same parameters under the same names (no alias), and a recomputed block must move
its BatchNorm's running statistics once per microbatch. PIPEPLAN_TEST_NORM=0: no BatchNorm
(replicated stages average their running statistics, which single-process training does not)."""

import os

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16) if os.environ.get("PIPEPLAN_TEST_NORM", "1") == "1" else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.lin(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.pos = nn.Parameter(torch.randn(16) * 0.1)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(self.inp(x)) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.out(self.shared(x) * self.pos)


def build_model() -> nn.Module:
    return Model()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)
