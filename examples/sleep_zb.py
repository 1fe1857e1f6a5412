"""A model whose layers wait rather than compute, with the backward's two parts apart: each
block sleeps F ms in its forward, B ms in the gradient of its input and W ms in the gradient of
its weight (custom autograd Functions on each branch), a stand-in for compute on any machine.
Zero-bubble schedules overlap the W's with the pipeline's bubbles. Environment:
PIPEPLAN_SLEEP_F_MS (10), PIPEPLAN_SLEEP_B_MS (= F), PIPEPLAN_SLEEP_W_MS (= F),
PIPEPLAN_SLEEP_BLOCKS (4), PIPEPLAN_SLEEP_DIM (16)."""

import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

F_MS = float(os.environ.get("PIPEPLAN_SLEEP_F_MS", "10"))
B_MS = float(os.environ.get("PIPEPLAN_SLEEP_B_MS", str(F_MS)))
W_MS = float(os.environ.get("PIPEPLAN_SLEEP_W_MS", str(F_MS)))
BLOCKS = int(os.environ.get("PIPEPLAN_SLEEP_BLOCKS", "4"))
DIM = int(os.environ.get("PIPEPLAN_SLEEP_DIM", "16"))


def _sibling(name: str):  # noqa: ANN202
    """The example file `name` next to this one (model files are imported by path, not as a
    package): its waits are this model's too."""
    spec = importlib.util.spec_from_file_location(f"pipeplan_example_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wait_ms = _sibling("sleep").wait_ms  # sleep to 0.2 ms before the deadline, then spin


class WaitInput(torch.autograd.Function):
    """Identity on the activations; sleeps F ms forward and B ms backward."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        wait_ms(F_MS)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        wait_ms(B_MS)
        return grad


class WaitWeight(torch.autograd.Function):
    """Identity on the weight; its backward (the weight's gradient) sleeps W ms."""

    @staticmethod
    def forward(ctx, w):  # noqa: ANN001, ANN205
        return w.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        wait_ms(W_MS)
        return grad


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * WaitWeight.apply(self.w)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(WaitInput.apply(x))


class SleepNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)  # so that the first block's input needs a gradient
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
