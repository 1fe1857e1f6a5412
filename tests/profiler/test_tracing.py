"""Tracing the model's top-level forward (the glue between its blocks): a draw there from
Python's `random` or numpy's global generator ran once, while tracing, and would be a constant
of the graph (LayerDrop trained as if never dropping, or always dropping the same layers), so
it is refused; draws inside blocks run as written, torch's generator is kept as an op, and the
global generators are left as tracing found them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from profiler_helpers import run_pipeline
from torch import nn

from planner.errors import PipeplanError
from profiler.graph import trace

DRAWS = {"numpy": lambda: float(np.random.random()), "python": lambda: random.random()}


class _Block(nn.Module):
    def __init__(self, draw: str | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = 1.0 + 0.1 * DRAWS[self.draw]() if self.draw else 1.0  # runs as written
        return x + gain * torch.tanh(self.fc(x))


class _LayerDrop(nn.Module):
    """fairseq/wav2vec2-style LayerDrop in the top-level forward. `glue`: the generator it
    draws from there ("numpy", "python", "torch" or None); `block`: what the blocks draw from;
    `export`: a branch torch.fx cannot trace, so torch.export captures the forward."""

    def __init__(self, glue: str | None, block: str | None = None, export: bool = False) -> None:
        super().__init__()
        self.glue, self.export, self.p = glue, export, 0.1
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList([_Block(block) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.export and h.requires_grad:
            h = h * 2.0
        for layer in self.layers:
            if self.glue == "torch":
                h = torch.where(torch.rand((), device=h.device) < self.p, h, layer(h))
            elif self.glue == "torch, untraced" and torch.rand(()) < self.p:  # fx runs it once
                continue
            elif self.glue in DRAWS and DRAWS[self.glue]() < self.p:
                continue
            else:
                h = layer(h)
        return self.head(h)


def _seed() -> None:
    random.seed(7)
    np.random.seed(7)


def _same_global_state(py: object, npy: dict) -> bool:
    now = np.random.get_state(legacy=False)
    return random.getstate() == py and np.array_equal(now["state"]["key"], npy["state"]["key"]) \
        and now["state"]["pos"] == npy["state"]["pos"]


@pytest.mark.parametrize(("glue", "export"), [
    ("numpy", False), ("numpy", True), ("python", False), ("python", True),
    ("torch, untraced", False)])  # (torch.export records torch.rand: fx only)
def test_a_global_random_draw_in_the_top_level_forward_is_refused(glue: str, export: bool) -> None:
    """Before, the draw was traced as a constant: LayerDrop with p=0.1 trained bit for bit as
    p=0, and with p=0.5 the profile left layers out. Now an error names the forward and what
    to do, and the generators are as they were."""
    model = _LayerDrop(glue, export=export)
    _seed()
    torch_state = torch.get_rng_state()
    py, npy = random.getstate(), np.random.get_state(legacy=False)
    generator = {"numpy": "numpy's global random generator", "python": "Python's random",
                 "torch, untraced": "torch's default generator"}[glue]
    with pytest.raises(PipeplanError, match=rf"_LayerDrop.forward draws from \(or seeds\) {generator} .*torch.rand"):
        trace(model, (torch.ones(6, 4),), granularity="blocks")
    assert _same_global_state(py, npy) and torch.equal(torch.get_rng_state(), torch_state)


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("block", ["numpy", "python"])
def test_blocks_drawing_from_global_generators_trace_and_leave_them_as_they_were(
        block: str, export: bool) -> None:
    """Blocks run as written (torch.export runs them while tracing: their draws are not the
    glue's), and tracing, which runs them, puts the generators back."""
    _seed()
    py, npy = random.getstate(), np.random.get_state(legacy=False)
    lg = trace(_LayerDrop(None, block=block, export=export), (torch.randn(6, 4),), granularity="blocks")
    assert lg.layer_names()[1:4] == ["layers.0", "layers.1", "layers.2"]
    assert _same_global_state(py, npy)


def test_torch_rand_in_the_top_level_forward_is_kept_as_an_op() -> None:
    """The advice the refusal gives works: torch's generator in a tensor op is in the graph,
    so the stages draw anew on every call, as the model does."""
    torch.manual_seed(0)
    model = _LayerDrop("torch")
    x = torch.randn(6, 4)
    lg = trace(model, (x,), granularity="blocks")
    assert any(n.op == "call_function" and n.target is torch.rand for n in lg.gm.graph.nodes)
    names = lg.layer_names()
    for seed in range(4):  # drops differ from seed to seed; the stages match the model on each
        torch.manual_seed(seed)
        want = model(x)
        torch.manual_seed(seed)
        got, _, _ = run_pipeline(lg, [[n] for n in names], (x,), torch.zeros(6, 2),
                                 nn.functional.mse_loss)
        assert torch.allclose(got, want, atol=1e-6)
