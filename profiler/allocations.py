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

from collections.abc import Callable
from typing import Any

import torch


def peak_new_bytes(work: Callable[[], Any], device: torch.device) -> tuple[int | None, Any]:
    """(peak bytes `work()` held allocated at once beyond those allocated before it started,
    what `work()` returned). Frees of memory allocated before the start count against the
    running total on CUDA (on CPU they are not seen, see above), so the figure is the peak
    increase over the starting level, never below 0.
    None where it cannot be measured (on CPU, when another profiler is already running: the
    work then runs unmeasured)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = work()
        torch.cuda.synchronize(device)
        return max(0, int(torch.cuda.max_memory_allocated(device)) - before), result
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    if torch._C._autograd._profiler_enabled():  # the caller's own profiler: leave it alone
        return None, work()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    try:
        prof.start()
    except RuntimeError:
        return None, work()
    try:
        result = work()
    finally:
        prof.stop()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
    events.sort()
    total = peak = 0
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return peak, result
