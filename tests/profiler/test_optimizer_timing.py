"""The optimizer step's time, per layer and for the whole model (`profiler.optimizers`)."""

from __future__ import annotations

import pytest
import torch
from profiler_helpers import EXAMPLES
from torch import nn

from profiler.optimizers import OPTIMIZERS, make_optimizer, step_ms, step_ms_all, unique_trainable
from profiler.profile import profile_model_file

CPU = torch.device("cpu")


def test_the_step_runs_on_copies_and_leaves_the_model_alone() -> None:
    lin = nn.Linear(64, 64)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    lin.weight.grad = torch.ones_like(lin.weight)
    for name in OPTIMIZERS:
        assert step_ms(lin.parameters(), name, CPU) > 0
    assert all(torch.equal(before[k], v) for k, v in lin.state_dict().items())
    assert torch.equal(lin.weight.grad, torch.ones_like(lin.weight)) and lin.bias.grad is None


def test_no_trainable_parameter_no_step() -> None:
    frozen = nn.Linear(8, 8).requires_grad_(False)
    assert step_ms_all(frozen.parameters(), CPU) == {"sgd": 0.0, "momentum": 0.0, "adam": 0.0}
    assert step_ms_all([], CPU)["adam"] == 0.0


def test_tied_parameters_step_once() -> None:
    a = nn.Linear(8, 8)
    assert unique_trainable([a.weight, a.bias, a.weight]) == [a.weight, a.bias]


def test_adam_is_the_runtimes_and_costs_more_than_sgd() -> None:
    """Adam updates two moments per element; on 4M parameters its step is several times SGD's
    (a margin no load on this machine closes: both run in the same few milliseconds)."""
    big = [nn.Parameter(torch.zeros(2048, 2048))]
    assert isinstance(make_optimizer("adam", big, 1e-3), torch.optim.Adam)
    assert make_optimizer("momentum", big, 1e-3).defaults["momentum"] == 0.9
    with pytest.raises(ValueError, match="optimizer 'lamb'"):
        make_optimizer("lamb", big, 1e-3)
    times = step_ms_all(big, CPU, repeats=5)
    assert times["adam"] > 1.5 * times["sgd"] > 0


def test_profile_has_each_layers_step(small_env) -> None:
    prof = profile_model_file(EXAMPLES / "mlp.py", batch_size=4, warmup=1, repeats=2)
    for x in prof.layers:
        trained = x.param_bytes - (x.frozen_param_bytes or 0)
        assert set(x.optimizer_ms) == set(OPTIMIZERS)
        assert (min(x.optimizer_ms.values()) > 0) == (trained > 0)
    assert any(x.optimizer_ms["adam"] > 0 for x in prof.layers)
    from planner.commands.profile import format_profile

    total = sum(x.optimizer_ms["adam"] for x in prof.layers)
    assert "optimizer step per iteration (sum of layers): sgd " in format_profile(prof)
    assert f"adam {total:.3f} ms" in format_profile(prof)
