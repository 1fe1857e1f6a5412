"""A block whose output is a transposed view (`y.t()`), read by the next block as `x.t()`: a
matmul of a transposed input takes another kernel path than of a contiguous copy, with other
rounding, so a cut there reproduces single-process training only if the receiver gets the
sender's strides."""

import torch
from torch import nn


class Transposing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(48, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)).t()


class ReadsTransposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(48, 48)

    def forward(self, xt: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(xt.t()))


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 48), Transposing(), ReadsTransposed(), nn.Linear(48, 4))


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
