"""glibc's allocator, set for a training process: memory freed by one step is kept for the next.

On the CPU every tensor comes from glibc's malloc. With its defaults, the memory a step frees is
partly given back to the system (heap trimming, and large blocks served by mmap and unmapped on
free), and the next step faults it in again: tens of thousands of page faults per step, a cost
that depends on the heap's history rather than on the training code, so that two identical
loops differ by several percent (benchmarks/overhead.py). A training process reuses the same
sizes every step, so train.py pins the two thresholds once, at start-up, before torch allocates
anything: blocks up to MMAP_THRESHOLD come from the heap, and the heap is trimmed only beyond
TRIM_THRESHOLD. What is set is recorded in config.json (environment.allocator).

A user's own settings win: with MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES
in the environment nothing is changed. Other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# The values benchmarks/overhead.py's "pinned thresholds" measure. A block above the mmap threshold
# that a thread's own arena cannot hold is still mmapped (glibc falls back to it).
MMAP_THRESHOLD = 2**30
TRIM_THRESHOLD = 2**30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_applied: dict | None = None


def keep_freed_memory() -> dict | None:
    """Pin glibc's mmap and trim thresholds (once per process); what was set, or None."""
    global _applied
    if _applied is not None:
        return _applied
    if platform.libc_ver()[0] != "glibc" or any(os.environ.get(name) for name in USER_SETTINGS):
        return None
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = {}
    for name, param, value in (("mmap_threshold", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                               ("trim_threshold", M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if mallopt(param, value) == 1:  # mallopt returns 1 on success
            applied[name] = value
    _applied = applied or None
    return _applied


def describe() -> dict:
    """The allocator settings of this process, for the run record."""
    if _applied:
        return {"set_by": "train.py", **_applied}
    user = {name: os.environ[name] for name in USER_SETTINGS if os.environ.get(name)}
    return {"set_by": "environment", **user} if user else {"set_by": None}
