"""A backward that needs a tensor a later microbatch's forward changed in place (an EMA teacher
updated in forward): one line naming the stage, the microbatch and the tensor, with the fix
(runtime.later_forward), where torch's raw error and the runtime's stack were."""

from __future__ import annotations

import re

import pytest
import torch
from runtime_paths import MODELS
from torch import nn

from runtime import later_forward


def _ema_forward(teacher: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        teacher.weight.mul_(0.9).add_(1.0, alpha=0.1)
    return teacher(x).sum()


def test_autograds_error_names_the_weight_a_later_forward_changed() -> None:
    teacher = nn.Linear(4, 4).requires_grad_(False)
    named = later_forward.named_state(teacher)
    x0, x1 = (torch.randn(2, 4, requires_grad=True) for _ in range(2))
    first = _ema_forward(teacher, x0)
    then = later_forward.state_versions(named)
    _ema_forward(teacher, x1)  # the next microbatch's forward, before the first's backward
    with pytest.raises(RuntimeError) as raised:
        first.backward()
    assert later_forward.changed_by_later_forward(raised.value, named, then) == ["weight"]
    assert later_forward.changed_by_later_forward(RuntimeError("other"), named, then) is None


def test_the_first_steps_saved_tensor_hooks_see_it_too() -> None:
    """Under count_saved_bytes autograd checks no version: the backward ran on the changed
    weight, silently unlike one process; the saved storages tell it."""
    from profiler.measure import count_saved_bytes

    teacher = nn.Linear(4, 4).requires_grad_(False)
    named = later_forward.named_state(teacher)
    saved: set[int] = set()
    with count_saved_bytes(list(teacher.parameters()), saved):
        _ema_forward(teacher, torch.randn(2, 4, requires_grad=True))
    then = later_forward.state_versions(named)
    ptrs = later_forward.storage_ptrs(named)
    assert later_forward.changed_since_saved(named, ptrs, then, saved) == []
    _ema_forward(teacher, torch.randn(2, 4, requires_grad=True))
    assert later_forward.changed_since_saved(named, ptrs, then, saved) == ["weight"]


def test_the_first_steps_check_sees_a_change_through_data() -> None:
    """`.data` writes move no version: a teacher moved that way (or a frozen weight two blocks
    share, one moving it) trained 8.9e-5 off one process without recomputation, silently (an
    outside review); the fingerprints of what autograd saved tell it."""
    from profiler.measure import count_saved_bytes

    teacher = nn.Linear(4, 4).requires_grad_(False)
    named = later_forward.named_state(teacher)
    ptrs = later_forward.storage_ptrs(named)
    saved: set[int] = set()
    with count_saved_bytes(list(teacher.parameters()), saved):
        teacher(torch.randn(2, 4, requires_grad=True)).sum()
    then, prints = later_forward.state_versions(named), later_forward.saved_prints(named, ptrs, saved)
    teacher.weight.data.mul_(0.9).add_(1.0, alpha=0.1)  # the next microbatch's forward
    assert later_forward.changed_since_saved(named, ptrs, then, saved) == []  # (versions alone)
    assert later_forward.changed_since_saved(named, ptrs, then, saved, prints) == ["weight"]


@pytest.mark.parametrize(("schedule", "through_data"), [("1f1b", False), ("gpipe", False), ("1f1b", True)])
def test_a_pipelined_ema_teacher_fails_in_one_line_with_the_fix(run, schedule: str, through_data: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEPLAN_EMA_THROUGH_DATA", "1" if through_data else "0")
    model = MODELS / "ema_teacher.py"
    plan = run.plan(model, [2, 2], schedule=schedule, global_batch=8, microbatch_size=2)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 2, "--timeout", 60)
    assert rc == 2 and "Traceback" not in err, err
    # (under gpipe either stage may fail first)
    assert re.search(r"stage (\d), microbatch 0: .*changed it in place \(here 'blocks\.\1\.teacher\.weight'\)",
                     err), err
    assert err.count("\n") == 1 and "teacher.weight.clone()" in err, err
