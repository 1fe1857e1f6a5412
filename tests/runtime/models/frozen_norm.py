"""Fine-tuning with a frozen, pre-trained BatchNorm: build_model leaves `blocks.1.norm` in eval
mode (it normalises with its running statistics and never updates them) and the rest in training
mode. PIPEPLAN_TEST_EVAL=1 returns the whole model in eval mode (as transformers'
from_pretrained does), PIPEPLAN_TEST_DROPOUT=1 adds a dropout the user switched off."""

import os

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.norm(self.lin(h))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def build_model() -> nn.Module:
    m = Net()
    with torch.no_grad():  # "pre-trained" statistics
        m.blocks[1].norm.running_mean.fill_(0.3)
        m.blocks[1].norm.running_var.fill_(2.0)
    m.blocks[1].norm.eval()
    for b in m.blocks:
        b.drop.eval() if os.environ.get("PIPEPLAN_TEST_DROPOUT") != "1" else b.drop.train()
    if os.environ.get("PIPEPLAN_TEST_EVAL") == "1":
        m.eval()
    return m


def make_batch(n: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return (torch.randn(n, 5),), torch.randn(n, 2)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)
