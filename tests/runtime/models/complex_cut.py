"""A complex tensor (an FFT) made by one block and read by the next: where a stage boundary
falls between them, the runtime refuses it by name (sent as their real views, complex tensors
trained 3e-3 away from one process)."""

import torch
from torch import nn

D = 8


class Spectrum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(self.fc(x))


class Back(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(torch.fft.ifft(c).real))


def build_model() -> nn.Module:
    return nn.Sequential(Spectrum(), Back(), nn.Linear(D, 2))


def make_batch(n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(n, D),), torch.randn(n, 2)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()
