"""A backward that fails because a later microbatch's forward changed, in place, a tensor this
microbatch's backward needs (internal module of runtime.executor).

A forward that updates a parameter or buffer in place which autograd saved for the backward (an
EMA / momentum teacher: a frozen `nn.Linear` whose weight the forward moves under no_grad while
the gradient flows through its input, so the Linear saved its weight) trains in one process,
where each microbatch's backward comes before the next microbatch's forward. A pipeline runs
later microbatches' forwards first (1F1B, ZB-H1 and GPipe alike); torch's backward then finds the
saved tensor changed ("... modified by an inplace operation ... is at version 14; expected
version 12"). `state_versions` notes, after each forward, the version counters of the stage's
parameters and buffers; `changed_by_later_forward` names those which that error is about.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from planner.errors import first_line

INPLACE_MODIFIED = "modified by an inplace operation"
_VERSIONS = re.compile(r"is at version (\d+); expected version (\d+)")


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The stage's parameters and buffers, each tensor once, under its first state_dict name."""
    seen: set[int] = set()
    named = []
    for name, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            named.append((name, t))
    return named


def state_versions(named: Sequence[tuple[str, torch.Tensor]]) -> list[int]:
    """Each tensor's version counter (it moves with every in-place change)."""
    return [t._version for _, t in named]


def storage_ptrs(named: Sequence[tuple[str, torch.Tensor]]) -> list[int]:
    """Each tensor's storage, as `profiler.measure.count_saved_bytes` tells saved tensors apart."""
    from profiler.measure import _storage_key

    return [_storage_key(t)[0] for _, t in named]


def saved_prints(named: Sequence[tuple[str, torch.Tensor]], ptrs: Sequence[int],
                 saved: set[int]) -> dict[int, tuple[float, ...]]:
    """Per index into `named`, a sampled fingerprint of each parameter autograd saved (`saved`):
    a change through `.data` moves no version (`changed_since_saved`). Parameters only: a
    BatchNorm saves its running statistics, which its backward does not read, and every forward
    moves them (without moving their version on CPU)."""
    from profiler.module_state import fingerprint

    return {i: fingerprint(t, sample=True) for i, ((_, t), ptr) in enumerate(zip(named, ptrs, strict=True))
            if ptr in saved and isinstance(t, nn.Parameter)}


def changed_since_saved(named: Sequence[tuple[str, torch.Tensor]], ptrs: Sequence[int],
                        then: Sequence[int], saved: set[int],
                        prints: dict[int, tuple[float, ...]] | None = None) -> list[str]:
    """The names of the tensors a microbatch's forward had autograd save (`saved`: their storages,
    as `count_saved_bytes` records them) that changed in place since (`then`: their
    `state_versions` after it; `prints`: their `saved_prints`, for changes through `.data`).
    Under `count_saved_bytes`'s hooks (a run's first step) autograd itself does not check: its
    backward would run on the changed tensors, unlike one process."""
    from profiler.module_state import fingerprint, same

    prints = prints or {}
    return [name for i, ((name, t), ptr, v) in enumerate(zip(named, ptrs, then, strict=True))
            if ptr in saved and (t._version != v or (i in prints and not same(fingerprint(t, sample=True), prints[i])))]


def _versions(exc: BaseException) -> tuple[int, int] | None:
    """(now, expected): the failing saved tensor's versions that torch's error names."""
    found = _VERSIONS.search(str(exc))
    return (int(found[1]), int(found[2])) if found else None


def changed_by_later_forward(exc: BaseException, named: Sequence[tuple[str, torch.Tensor]],
                             then: Sequence[int]) -> list[str] | None:
    """The names of the stage's tensors that `exc` (torch's in-place error in a microbatch's
    backward) is about and that changed since that microbatch's forward ended (`then`, its
    `state_versions`): their version is now the one the error names, then it was below it and at
    least the one autograd expected. None where `exc` is not that error or names none of them."""
    if not isinstance(exc, RuntimeError) or INPLACE_MODIFIED not in str(exc):
        return None
    if (versions := _versions(exc)) is None:
        return None
    now, expected = versions
    names = [name for (name, t), v in zip(named, then, strict=True)
             if t._version == now and expected <= v < now]
    return names or None


def message(stage: int, mb: int, names: Sequence[str] | None, exc: BaseException | None) -> str:
    """One line: what failed, why a pipeline differs from one process, what to do. Without
    `names` (the changed tensor is none of the stage's parameters and buffers: a plain tensor
    attribute, a global) it says what most likely happened, given that a later forward ran."""
    if names:
        what = (f"stage {stage}, microbatch {mb}: its backward needs a tensor as its forward left "
                "it, and a later microbatch's forward changed it in place (here "
                f"{', '.join(map(repr, names))})")
    else:
        what = (f"stage {stage}, microbatch {mb}: the backward fails on a tensor changed in place "
                f"since its forward ({first_line(str(exc).split('. Hint')[0], 160)}); if the model "
                "trains in one process, a later microbatch's forward changed it (a tensor that is "
                "no parameter or buffer of the stage)")
    return (
        f"{what}. One process trains such a model (an EMA/momentum teacher updated in forward "
        "under no_grad, a frozen nn.Linear whose weight autograd saved for its input's "
        "gradient): each microbatch's backward runs before the next forward. A pipeline runs "
        "later microbatches' forwards first (1F1B, ZB-H1 and GPipe alike). Make the forward use "
        "a copy of what it updates, e.g. F.linear(x, self.teacher.weight.clone(), "
        "self.teacher.bias.clone()): backward keeps the copy, and it trains as one process does")
