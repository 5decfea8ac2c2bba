"""Memory, one definition for every backend: what is measured, and what a backend holds.

CUDA: the caching allocator's peak allocated and peak reserved bytes, reset at the start of the
timed window, and the average allocated bytes sampled after every timed step (AllocatorMeter).
CPU has no such allocator, and RSS mostly measures the Python runtime and allocator caches; there
the peak is that of live tensor bytes in a profiled window (core/memory_profile.py), which also
gives the breakdown by category on both devices.

What a backend holds comes through a small interface, MemoryAccounting (its state tensors by role,
and the unsharded parameters a sharded backend keeps between forward and backward);
ModelStateMeter turns it into the record's `model_state_bytes`.
"""

from __future__ import annotations

import os
import resource
from abc import ABC, abstractmethod

import torch
import torch.nn as nn

PHASES = ("forward", "backward", "optimizer")
MARK = "gptlite::"  # prefix of the profiler ranges that mark the step's phases


def phase(name: str):
    """Marks a phase of the step in profiler traces (and for the memory categories)."""
    return torch.profiler.record_function(MARK + name)


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


def storage_roles(tensors_by_role: dict[str, list[torch.Tensor]]) -> dict[int, tuple[str, int, str]]:
    """{storage data pointer: (role, storage bytes, device type)} for the given tensors.

    Views share their storage, so each storage counts once (under the first role that names it);
    None and freed (empty) storages are skipped.
    """
    roles: dict[int, tuple[str, int, str]] = {}
    for role, tensors in tensors_by_role.items():
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.nbytes():
                roles.setdefault(storage.data_ptr(), (role, storage.nbytes(), t.device.type))
    return roles


class MemoryAccounting(ABC):
    """What one rank's backend holds, by role: the interface between a backend and the memory
    measurements (each backend returns one from `Backend.accounting()`)."""

    @abstractmethod
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's model state right now, by role: "parameter", "gradient", "optimizer_state"
        (local shards; views and aliases are fine, each storage is counted once)."""

    def gathered_root(self) -> nn.Module | None:
        """A sharded backend's module whose forward hook sees the unsharded parameters still
        allocated (from forward until backward frees them); None: nothing is gathered."""
        return None

    def gathered_bytes(self) -> int:
        """Unsharded parameter bytes allocated right now."""
        return 0

    def breakdown_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors the memory breakdown labels by role (default: the state tensors)."""
        return self.state_tensors()


class ModelStateMeter:
    """Model-state bytes per rank (runs/README.md, `model_state_bytes`) from a MemoryAccounting.

    `watch_gathered` arms a forward hook for the step being measured: after forward it notes the
    unsharded parameters still allocated (the bytes SHARD_GRAD_OP or ZeRO-3 keep until backward).
    """

    def __init__(self, accounting: MemoryAccounting, device: torch.device):
        self.accounting = accounting
        self.device = device
        self.gathered = 0
        self._hook = None

    def watch_gathered(self) -> None:
        root = self.accounting.gathered_root()
        if root is not None and self._hook is None:
            def hook(module, args, output):
                self.gathered = self.accounting.gathered_bytes()

            self._hook = root.register_forward_hook(hook)

    def roles(self) -> dict[int, tuple[str, int, str]]:
        return storage_roles(self.accounting.breakdown_tensors())

    def model_state_bytes(self) -> dict[str, int]:
        """Called after the last backward of a step, before the optimizer step, so gradients exist."""
        out = {"params": 0, "params_gathered": self.gathered, "grads": 0, "optimizer": 0, "offloaded": 0}
        field = {"parameter": "params", "gradient": "grads", "optimizer_state": "optimizer"}
        tensors = self.accounting.state_tensors()
        for role, size, _ in storage_roles(tensors).values():
            out[field[role]] += size
        if self.device.type != "cpu":
            # Host-resident state; 0-dim tensors are host scalars (AdamW's step counters), not offload.
            host = {role: [t for t in ts if t is not None and t.device.type == "cpu" and t.dim() > 0]
                    for role, ts in tensors.items()}
            out["offloaded"] = sum(size for _, size, _ in storage_roles(host).values())
        return out

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
