"""The memory profile of the run's last step(s): peak, average and breakdown of live tensor bytes,
and (core/comm.py) the step's collectives.

Built from torch.profiler's raw allocation events (`profile_memory=True`):
- every block allocated or freed in the window is tracked exactly, on every thread (gloo's
  worker threads too);
- blocks that existed before the window are sized from the backend's own tensors and from the
  tensors ops read (`record_shapes=True`).

Each block live at the peak gets a category, by role first, then by when it was allocated:
- `parameter`, `gradient`, `optimizer_state`: the storage held a parameter (sharded or gathered),
  a gradient or optimizer state when the backend was asked (window start, after each forward,
  after each backward, after the optimizer step);
- `activation`: allocated during forward and still alive: what forward keeps for backward;
- `temporary`: allocated during backward or the optimizer step and not state: recomputed
  activations, autograd buffers, parameters re-gathered for backward, communication buffers;
- `data`: the storage of a tensor the dataset holds (a user's TensorDataset on a CPU run): the
  data in the same memory as training, counted apart so the estimate can count the same bytes;
- `other`: anything else (the batch, buffers that predate the window without a known role).

Why not torch.profiler's own categories (torch.profiler._memory_profiler)? Their data-flow
analysis assumes each tensor is allocated once; FSDP and DeepSpeed free and re-allocate the same
tensors' storage every step (`storage.resize_`), which makes it raise or, with its checks skipped,
misplace those allocations in time.

On CUDA the profiled window runs too, for the breakdown; the peak stays the allocator's.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass

import torch
from torch._C._profiler import _EventType, _TensorMetadata
from torch.profiler._utils import traverse_dfs

from core.comm import KINDS, collectives, process_groups, transfers
from core.memory import MARK as _MARK
from core.memory import PHASES, current_rss_bytes

CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "data", "other")


@dataclass
class _Block:
    ptr: int
    size: int
    start: float  # -inf: existed before the window
    end: float  # +inf: still alive at its end
    phase: str | None = None
    role: str | None = None
    collective: bool = False  # allocated inside a c10d collective, or (an unseen free's) passed to one
    unseen_free: bool = False  # its address was allocated again with no free recorded in between

    def alive(self, t: float) -> bool:
        return self.start <= t < self.end


class ProfiledWindow:
    """Profile the enclosed steps' memory; `result()` gives the peak, average and breakdown.

    `snapshot(roles)` records which storages hold parameters, gradients and optimizer state at
    that moment (see `storage_roles`); the loop calls it at the window start and after each
    forward, backward and optimizer step.
    """

    def __init__(self, device: torch.device):
        self.device = device
        # Kineto prints a banner at every profiler start and stop; level 6 keeps it quiet.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # record_shapes: the sizes of tensors that existed before the window, from the ops using them.
        self.profiler = torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True)
        self.snapshots: list[dict[int, tuple[str, int, str]]] = []
        self._groups_at_start: dict[str, tuple[tuple[int, ...], int]] = {}
        self.group_calls: dict[str, tuple[tuple[int, ...], int]] = {}  # group name -> (ranks, calls)

    def __enter__(self):
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        self.profiler.__exit__(*exc)
        table = os.environ.get("GPTLITE_PROFILE_TABLE")
        if table:  # where the profiled step's time goes, op by op (docs/records.md)
            sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            Path(table).write_text(self.profiler.key_averages().table(sort_by=sort, row_limit=40) + "\n")
        return False

    def count_groups(self, start: bool) -> None:
        """Called at a profiled step's start and end: the calls of each process group in between
        (core.comm.process_groups; the harness's own exchanges between steps left out)."""
        now = process_groups()
        if start:
            self._groups_at_start = now
            return
        for name, (ranks, seq) in now.items():
            before = self._groups_at_start.get(name)
            if before is not None:
                calls = self.group_calls.get(name, (ranks, 0))[1]
                self.group_calls[name] = (ranks, calls + seq - before[1])

    def snapshot(self, roles: dict[int, tuple[str, int, str]]) -> None:
        with torch.profiler.record_function(f"{_MARK}snapshot{len(self.snapshots)}"):
            self.snapshots.append(roles)

    def result(self) -> dict:
        events = list(traverse_dfs(self.profiler.profiler.kineto_results.experimental_event_tree()))
        phases, snapshot_times = [], {}
        for e in events:
            if e.typed[0] == _EventType.TorchOp and e.name.startswith(_MARK):
                label = e.name[len(_MARK):]
                if label in PHASES:
                    phases.append((e.start_time_ns, e.end_time_ns, label))
                elif label.startswith("snapshot"):
                    snapshot_times[int(label[len("snapshot"):])] = e.start_time_ns
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        spans = [(start, end) for start, end, _ in phases]
        step = {"collectives": collectives(events, spans, world), "transfers": transfers(events, spans),
                "groups": [{"name": name, "ranks": list(r), "calls": c}
                           for name, (r, c) in sorted(self.group_calls.items(), key=lambda x: (x[1][0], x[0]))]}
        blocks = self._blocks(events, _EventType)
        if not blocks:
            return step
        for b in blocks:
            if b.start != float("-inf"):
                b.phase = next((name for start, end, name in phases if start <= b.start <= end), None)
        for index, roles in enumerate(self.snapshots):
            t = snapshot_times.get(index)
            if t is None:
                continue
            for b in blocks:
                if b.role is None and b.ptr in roles and b.alive(t):
                    b.role = roles[b.ptr][0]
        return {**_peak_and_breakdown(blocks), **step}

    def _blocks(self, events, _EventType) -> list[_Block]:
        device = self.device
        early: dict[int, _Block] = {}  # existed before the window, by pointer
        allocations = sorted(
            (e for e in events if e.typed[0] == _EventType.Allocation and e.typed[1].device == device),
            key=lambda e: e.start_time_ns)
        blocks = _replay(allocations)
        _end_unseen_frees(blocks, events, _EventType)

        # A pointer names a block from before the window until the window first allocates there.
        first_allocation: dict[int, float] = {}
        for b in blocks:
            first_allocation.setdefault(b.ptr, b.start)

        def existed_before(ptr: int, t: float) -> bool:
            return first_allocation.get(ptr, float("inf")) > t

        def note_early(ptr: int, size: int) -> None:
            block = early.get(ptr)
            if block is None:
                early[ptr] = block = _Block(ptr, size, float("-inf"), first_allocation.get(ptr, float("inf")))
            block.size = max(block.size, size)

        # Blocks from before the window: the backend's own tensors at the first snapshot...
        for ptr, (_, size, where) in (self.snapshots[0].items() if self.snapshots else ()):
            if where == device.type and ptr not in first_allocation:  # offloaded state is not on the device
                note_early(ptr, size)
        # ...and every tensor an op read whose storage was not allocated in the window before.
        for e in events:
            if e.typed[0] != _EventType.TorchOp:
                continue
            for t in _flat_tensors(e.typed[1].inputs):
                if t.device == device and t.storage_data_ptr and existed_before(t.storage_data_ptr, e.start_time_ns):
                    note_early(t.storage_data_ptr, _extent_bytes(t))
        return blocks + list(early.values())


def _within_collective(event) -> bool:
    parent = event.parent
    while parent is not None:
        if parent.name in KINDS:
            return True
        parent = parent.parent
    return False


def _replay(allocations) -> list[_Block]:
    """The blocks that the profiler's allocation events (in time order) describe: each from its
    allocation to its free. An address handed out again ends the block there (freed unseen); a free of
    a block allocated before profiling carries no event (torch warns instead)."""
    blocks: list[_Block] = []
    live: dict[int, _Block] = {}
    for e in allocations:
        a, t = e.typed[1], e.start_time_ns
        if a.alloc_size > 0:
            before = live.get(a.ptr)
            if before is not None:
                before.end, before.unseen_free = t, True
            live[a.ptr] = block = _Block(a.ptr, a.alloc_size, t, float("inf"), collective=_within_collective(e))
            blocks.append(block)
        elif a.ptr in live:
            live.pop(a.ptr).end = t
    return blocks


def _end_unseen_frees(blocks: list[_Block], events, _EventType) -> None:
    """End the blocks a collective held whose free the profiler did not see, at their last recorded use.

    The profiler records allocations and frees only on threads that carry its state: the training
    thread, and gloo's worker threads while they run a collective. A gloo collective's work holds
    its tensors (inputs, outputs, its own copies) until the worker thread drops the finished work.
    When the training thread has let go of them first, the last free happens there, unrecorded, and
    the block would count as alive until its address is handed out again or the window ends. Which
    thread lets go last is a race. (Measured on the zoo's frozen_tied, FSDP2, 2 ranks, micro-batch
    4 x 2: identical runs' peaks 349-488 KB, all-gather outputs and gloo's reduce-scatter copies
    counted alive long after FSDP2 had copied out of them; 349 KB where every free was recorded.)
    Such a block, one a collective held (allocated inside it or passed to it), ends when the last
    recorded op that read it ends. The time the worker thread kept it beyond that is not counted."""
    unseen = [b for b in blocks if b.start != float("-inf") and (b.end == float("inf") or b.unseen_free)]
    if not unseen:
        return
    by_ptr: dict[int, list[_Block]] = {}
    for b in unseen:
        by_ptr.setdefault(b.ptr, []).append(b)
    last_use: dict[int, float] = {}  # id(block) -> the end of the last op that read it
    for e in events:
        if e.typed[0] != _EventType.TorchOp:
            continue
        for t in _flat_tensors(e.typed[1].inputs):
            for b in by_ptr.get(t.storage_data_ptr, ()):
                if b.start <= e.start_time_ns < b.end:
                    if e.name in KINDS:
                        b.collective = True
                    last_use[id(b)] = max(last_use.get(id(b), b.start), e.end_time_ns)
    for b in unseen:
        if b.collective:
            b.end = min(b.end, max(b.start, last_use.get(id(b), b.start)))


def _flat_tensors(inputs):
    for value in inputs:
        if isinstance(value, _TensorMetadata):
            yield value
        elif isinstance(value, list):
            yield from (v for v in value if isinstance(v, _TensorMetadata))


def _extent_bytes(t) -> int:
    """Bytes a tensor view spans from its storage's start (a lower bound of the storage size)."""
    if any(s == 0 for s in t.sizes):
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(t.sizes, t.strides))
    return span * t.dtype.itemsize


def _category(b: _Block) -> str:
    if b.role is not None:
        return b.role
    return {"forward": "activation", "backward": "temporary", "optimizer": "temporary"}.get(b.phase, "other")


def _peak_and_breakdown(blocks: list[_Block]) -> dict:
    changes = sorted({b.start for b in blocks if b.start != float("-inf")} | {b.end for b in blocks
                                                                              if b.end != float("inf")})
    if not changes:
        total = sum(b.size for b in blocks)
        return {"peak_bytes": total, "avg_bytes": float(total), "breakdown": _breakdown(blocks, lambda b: True),
                "activation_peak_bytes": sum(b.size for b in blocks if _category(b) == "activation")}
    # Live bytes just after each change: +size at a start, -size at an end.
    delta: dict[float, int] = {}
    for b in blocks:
        if b.start != float("-inf"):
            delta[b.start] = delta.get(b.start, 0) + b.size
        if b.end != float("inf"):
            delta[b.end] = delta.get(b.end, 0) - b.size
    live = sum(b.size for b in blocks if b.start == float("-inf"))
    peak_bytes, peak_time, weighted = live, changes[0], 0.0
    for i, t in enumerate(changes):
        live += delta[t]
        if i + 1 < len(changes):
            weighted += live * (changes[i + 1] - t)
        if live > peak_bytes:
            peak_bytes, peak_time = live, t
    span = changes[-1] - changes[0]
    return {
        "peak_bytes": peak_bytes,
        "avg_bytes": weighted / span if span > 0 else float(peak_bytes),
        "breakdown": _breakdown(blocks, lambda b: b.alive(peak_time)),
        "activation_peak_bytes": _most_alive_at_once([b for b in blocks if _category(b) == "activation"]),
    }


def _most_alive_at_once(blocks: list[_Block]) -> int:
    """The largest total size of `blocks` alive at one time (frees before allocations at a tie)."""
    events = sorted([(b.start, b.size) for b in blocks] + [(b.end, -b.size) for b in blocks if b.end != float("inf")])
    live = most = 0
    for _, size in events:
        live += size
        most = max(most, live)
    return most


def _breakdown(blocks, alive) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for b in blocks:
        if alive(b):
            out[_category(b)] += b.size
    return out


class LoadPeak:
    """The peak of tensor bytes allocated and still live inside the window, on `device`: loading a
    checkpoint (Backend.build_model and, for FSDP2, its sharding). Counted from torch.profiler's
    allocation events (every thread's), as the run's CPU peak is (ProfiledWindow); blocks allocated
    before the window and freed in it are not subtracted. Beside it, the growth of the process's peak
    RSS over the window (VmHWM, reset on entry where Linux allows), for orientation only: it also
    counts the pages of memory-mapped checkpoint files read, the libraries loading imports, the
    profiler's own buffers and the allocator's caching.

    `mapped_sizes`: the checkpoint's file sizes. safetensors maps each file whole to read from it, which
    torch reports as an allocation of the file's size: not counted where the mapping is let go in the
    window (see __exit__)."""

    MEASURE = ("peak of torch-allocated bytes live in the loading window (torch.profiler allocation events, "
               "core/memory_profile.py LoadPeak)")

    def __init__(self, device: torch.device, mapped_sizes: set[int] = frozenset(), shapes: bool = True):
        self.device = device
        self.mapped_sizes = set(mapped_sizes)
        # The ops' inputs (record_shapes), to end what gloo's threads free unseen (core/memory_profile.py);
        # off where the window swaps parameters (FSDP2's to_empty: the profiler's references refuse it).
        self.shapes = shapes
        self.peak_bytes: int | None = None
        self.rss_growth_bytes: int | None = None

    def __enter__(self):
        try:  # "5": reset the peak RSS to the current RSS (proc(5), clear_refs)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._rss_reset = True
        except OSError:
            self._rss_reset = False
        self._rss0 = current_rss_bytes()
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                                record_shapes=self.shapes)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc):
        self._profiler.__exit__(*exc)
        if exc[0] is not None:
            return False
        events = list(traverse_dfs(self._profiler.profiler.kineto_results.experimental_event_tree()))
        allocations = sorted((e for e in events if e.typed[0] == _EventType.Allocation
                              and e.typed[1].device.type == self.device.type), key=lambda e: e.start_time_ns)
        blocks = _replay(allocations)
        # gloo's worker threads free what a collective held unrecorded: as the run's memory profile does.
        _end_unseen_frees(blocks, events, _EventType)
        # A checkpoint file mapped whole to read from it and let go in the window: its pages are the page
        # cache's, shared by the ranks, resident only where read, and what was read was copied into
        # tensors (counted). One still mapped at the end holds the model's tensors (from_pretrained's
        # weights are views of it, each rank's own once written): counted.
        blocks = [b for b in blocks if not (b.size in self.mapped_sizes and b.end != float("inf"))]
        changes = sorted([(b.start, b.size) for b in blocks] + [(b.end, -b.size) for b in blocks
                                                                 if b.end != float("inf")])
        total = peak = 0
        for _, size in changes:  # at equal times the free (negative) comes first
            total += size
            peak = max(peak, total)
        self.peak_bytes = peak
        if self._rss_reset:
            with open("/proc/self/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
            self.rss_growth_bytes = max(0, hwm - self._rss0)
        return False
