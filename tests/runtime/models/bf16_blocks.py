"""Residual blocks with bfloat16 parameters (the whole model in bfloat16, the loss in float32)."""

import torch
from torch import nn

D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(torch.nn.functional.gelu(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x.to(torch.bfloat16))).float()


def build_model() -> nn.Module:
    return Net().to(torch.bfloat16)


def make_batch(n: int):
    return (torch.randn(n, D),), torch.randn(n, 4)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
