"""The most bytes a piece of work allocates beyond what was allocated when it started.

Used for working memory that no saved-tensor hook sees: a loss's backward allocates the gradient
of what it saved (a cross-entropy: the log-probabilities' gradient) and the gradient of the
model's output, each as large as the logits, while the saved log-probabilities are still alive.

- CUDA: the caching allocator's own peak (`torch.cuda.max_memory_allocated` after
  `reset_peak_memory_stats`) less what was allocated at the start.
- CPU: PyTorch has no allocator statistics on CPU, so the work runs under `torch.profiler`
  with `profile_memory=True`, whose allocation events (every allocation and free of the CPU
  allocator, in order) give the running total; its maximum is the peak. Profiling costs time
  (about a second the first time in a process), so callers measure one run, not every run.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

MARK = "pipeplan::measured"  # the record_function around the measured work
_LOCK = threading.Lock()  # one CPU profile at a time in a process (kineto's state is global)


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints its start and stop, and c10 a warning about blocks allocated before the
    profile, straight to file descriptor 2: not for our users' terminals."""
    try:
        sys.stderr.flush()
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _setup(setup: Callable[[], Any] | None) -> tuple[Any, ...]:
    """`work`'s arguments: setup's result, or none."""
    return (setup(),) if setup is not None else ()


def peak_new_bytes(work: Callable[..., Any], device: torch.device,
                   setup: Callable[[], Any] | None = None) -> tuple[int | None, Any]:
    """(peak bytes held allocated at once while `work` ran, beyond those allocated when it
    started; what `work` returned), never below 0. With `setup`, `work(setup())`: setup runs
    first, unmeasured but seen, so that on CPU the frees of what setup allocated (a forward's
    saved tensors, freed by its backward) lower the running total during `work` as they do on
    CUDA. None where it cannot be measured (on CPU, when another profiler is already running:
    the work then runs unmeasured)."""
    if device.type == "cuda":
        arg = _setup(setup)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = work(*arg)
        torch.cuda.synchronize(device)
        return max(0, int(torch.cuda.max_memory_allocated(device)) - before), result
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    if torch._C._autograd._profiler_enabled():  # the caller's own profiler: leave it alone
        return None, work(*_setup(setup))
    with _LOCK:
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        try:
            with _quiet_stderr():
                prof.start()
        except RuntimeError:
            return None, work(*_setup(setup))
        try:
            arg = _setup(setup)
            with _quiet_stderr(), record_function(MARK):
                result = work(*arg)
        finally:
            with _quiet_stderr():
                prof.stop()
    events, window = [], None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
        elif e.name == MARK:
            window = (e.start_time_ns, e.end_time_ns)
    if window is None:  # (not seen: no figure rather than a wrong one)
        return None, result
    events.sort(key=lambda e: (e[0], -e[1]))  # at one instant, allocations before frees
    total = base = 0
    peak = None
    for t, nbytes in events:
        if t < window[0]:
            base = total = total + nbytes
            continue
        if t > window[1]:
            break
        total += nbytes
        peak = total if peak is None else max(peak, total)
    return max(0, (peak if peak is not None else base) - base), result
