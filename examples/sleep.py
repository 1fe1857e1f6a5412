"""A model whose layers wait rather than compute: each block sleeps F ms in its forward and 2F ms
in its backward (a custom autograd Function), a stand-in for I/O, custom kernels or anything
opaque to tracing. On any machine a pipeline of it should run at the ideal 1F1B time
(m + S - 1) * (F + 2F) per stage. Environment: PIPEPLAN_SLEEP_MS (F, 10), PIPEPLAN_SLEEP_BLOCKS (4),
PIPEPLAN_SLEEP_DIM (16)."""

import os
import time

import torch
from torch import nn


def f_ms() -> float:
    """F, read when the layer runs (a process that loaded this file earlier may change it)."""
    return float(os.environ.get("PIPEPLAN_SLEEP_MS", "10"))


BLOCKS = int(os.environ.get("PIPEPLAN_SLEEP_BLOCKS", "4"))
DIM = int(os.environ.get("PIPEPLAN_SLEEP_DIM", "16"))


def wait_ms(ms: float) -> None:
    """Wait exactly `ms` milliseconds: `time.sleep` until SPIN_MS before the deadline, then spin.
    A plain `time.sleep` wakes 0.1-0.2 ms late on a virtual machine, which would make every
    layer longer than its nominal time. PIPEPLAN_SLEEP_SPIN_MS (default 0.2) sets the spin;
    0 waits with `time.sleep` alone."""
    deadline = time.perf_counter() + ms / 1e3
    spin_s = float(os.environ.get("PIPEPLAN_SLEEP_SPIN_MS", "0.2")) / 1e3
    if spin_s <= 0:
        time.sleep(ms / 1e3)
        return
    if ms / 1e3 > spin_s:
        time.sleep(ms / 1e3 - spin_s)
    while time.perf_counter() < deadline:
        pass


class Wait(torch.autograd.Function):
    """Identity; sleeps F ms forward and 2F ms backward."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        wait_ms(f_ms())
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        wait_ms(2 * f_ms())
        return grad


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(Wait.apply(x)))


class SleepNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)  # so that every block's backward runs (and waits)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def build_model() -> nn.Module:
    return SleepNet()


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, DIM),), torch.randn(batch_size, DIM)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)
