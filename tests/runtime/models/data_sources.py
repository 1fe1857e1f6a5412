"""An MLP whose make_batch draws its data the way real data code does, chosen by
PIPEPLAN_TEST_DATA: `numpy` (numpy's global generator, inputs and targets a fixed function of
each other), `cursor` (a fixed dataset walked in order, as a DataLoader without shuffling:
state kept between calls) or `own-rng` (a numpy Generator of its own, seeded from the OS: other
rows on every process). PIPEPLAN_TEST_INIT `rank-arch` leaves the last bias out on ranks > 0; `numpy` / `own-rng` draws the first layer's initial
weights from numpy's global generator / that generator of its own."""

import os

import numpy as np
import torch
from torch import nn

_W = torch.linspace(-1.0, 1.0, 32).reshape(8, 4)
_X = torch.from_numpy(np.random.default_rng(123).standard_normal((512, 8)).astype(np.float32))
_cursor = [0]
_own = np.random.default_rng()


def build_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    init = os.environ.get("PIPEPLAN_TEST_INIT")
    if init == "rank-arch" and os.environ.get("RANK", "0") != "0":  # another model on ranks > 0
        model[4] = nn.Linear(16, 4, bias=False)
    if init in ("numpy", "own-rng"):
        draw = np.random.standard_normal if init == "numpy" else _own.standard_normal
        with torch.no_grad():
            model[0].weight.copy_(torch.from_numpy(0.3 * draw((16, 8)).astype(np.float32)))
    return model


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    source = os.environ.get("PIPEPLAN_TEST_DATA", "numpy")
    if source == "cursor":
        i = _cursor[0]
        _cursor[0] = (i + batch_size) % (512 - batch_size)
        x = _X[i:i + batch_size].clone()
    elif source == "own-rng":
        x = torch.from_numpy(_own.standard_normal((batch_size, 8)).astype(np.float32))
    else:
        x = torch.from_numpy(np.random.randn(batch_size, 8).astype(np.float32))
    return (x,), x @ _W


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()
