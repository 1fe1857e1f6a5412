"""Glow's ActNorm: each block sets its own parameters from the first batch it sees (through
`.data`, under no_grad), then trains them; a bool buffer says it has."""

import torch
from torch import nn

D = 16


class ActNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(D))
        self.logs = nn.Parameter(torch.zeros(D))
        self.register_buffer("initialized", torch.tensor(False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not self.initialized:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0))
                self.logs.data.copy_(-torch.log(x.std(0) + 1e-6))
                self.initialized.fill_(True)
        return (x + self.loc) * torch.exp(self.logs).clamp(max=2.0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.an = ActNorm()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.an(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.Sequential(*[Block() for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def build_model() -> nn.Module:
    return Net()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, 8) * 3 + 1,), torch.randn(batch_size, 4)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)
