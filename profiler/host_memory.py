"""Keep the host allocator's large blocks mapped, in the profiler and in every runtime rank alike.

glibc serves blocks of 128 KB and more with `mmap` (and later blocks from a heap it trims back
to the OS), so a tensor of a few MB allocated afresh each iteration page-faults on every touch.
How much a layer pays for that depends on what ran just before it: the GPT example's loss took
1.0-1.7 ms after a model's forward and backward and 0.2-0.5 ms in a loop of its own (hundreds
of minor faults against none; `benchmarks/README.md`, "The loss's price and glibc's large
blocks"). The profile must price what the run pays, so both set the same thresholds: nothing
below `MMAP_THRESHOLD` comes from `mmap`, and the heap is not trimmed — memory a step freed is
reused by the next, as CUDA's caching allocator does on a GPU. CPU tensors only; a no-op off
glibc.
"""

from __future__ import annotations

import ctypes
import functools
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # the most mallopt takes: in effect, never trim the heap


@functools.cache
def keep_large_blocks() -> bool:
    """Set the thresholds for this process (once); True where they took (Linux with glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own libc: no library search
    except (OSError, AttributeError):  # musl and other libcs: nothing to set
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all([mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1,
                mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1])
