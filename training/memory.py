"""Memory, one definition for every backend.

CUDA: the caching allocator's peak allocated and peak reserved bytes, reset at the start of the
timed window, and the average allocated bytes sampled after every timed step.

CPU has no such allocator, and RSS includes the Python runtime and allocator caches. There the
peak is the peak of live tensor bytes in torch.profiler's memory profile over a short profiled
window (the run's last steps), with the bytes of each category (parameter, gradient, optimizer
state, activation, temporary, ...) at that instant. Peak RSS is recorded beside it.

On CUDA the profiled window runs too, for the breakdown by category; the peak stays the
allocator's.
"""

from __future__ import annotations

import contextlib
import os
import resource
import warnings

import torch

# Names of the profiler's categories in its timeline's column order (None: not classified).
_PROFILER_CATEGORIES = None


def _category_names() -> list[str]:
    global _PROFILER_CATEGORIES
    if _PROFILER_CATEGORIES is None:
        from torch.profiler import _memory_profiler as mp

        _PROFILER_CATEGORIES = [c.name.lower() if c is not None else "unknown" for c in mp._CATEGORY_TO_INDEX]
    return _PROFILER_CATEGORIES


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class AllocatorMeter:
    """CUDA allocator statistics over the timed window (inactive on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.active = device.type == "cuda"
        self.samples: list[int] = []

    def start(self) -> None:
        if self.active:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.samples = []

    def sample(self) -> int | None:
        if not self.active:
            return None
        allocated = torch.cuda.memory_allocated(self.device)
        self.samples.append(allocated)
        return allocated

    def stats(self) -> dict:
        if not self.active or not self.samples:
            return {}
        return {
            "peak_bytes": torch.cuda.max_memory_allocated(self.device),
            "reserved_peak_bytes": torch.cuda.max_memory_reserved(self.device),
            "avg_bytes": sum(self.samples) / len(self.samples),
        }


class ProfiledWindow:
    """Profile the enclosed steps' memory; `result()` gives the peak, average and breakdown."""

    def __init__(self, device: torch.device):
        self.device = device
        # Kineto prints a banner at every profiler start and stop; level 6 keeps it quiet.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # The memory profile needs shapes and stacks to classify tensors (parameter, gradient,
        # optimizer state, activation) from the ops that use them.
        self.profiler = torch.profiler.profile(
            activities=activities, profile_memory=True, record_shapes=True, with_stack=True)

    def __enter__(self):
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        self.profiler.__exit__(*exc)
        return False

    def result(self) -> dict:
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            timeline = MemoryProfileTimeline(self.profiler._memory_profile())
            times, sizes = timeline._coalesce_timeline(str(self.device))
        if not times:
            return {}
        names = _category_names()
        # Column 0 of `sizes` is unused; column 1 + i holds category i.
        totals = [sum(row) for row in sizes]
        peak = max(range(len(totals)), key=totals.__getitem__)
        span = times[-1] - times[0]
        if span > 0:
            avg = sum(totals[i] * (times[i + 1] - times[i]) for i in range(len(times) - 1)) / span
        else:
            avg = float(totals[peak])
        return {
            "peak_bytes": totals[peak],
            "avg_bytes": avg,
            "breakdown": {name: sizes[peak][1 + i] for i, name in enumerate(names)},
        }


def maybe_profiled(enabled: bool, device: torch.device):
    return ProfiledWindow(device) if enabled else contextlib.nullcontext()
