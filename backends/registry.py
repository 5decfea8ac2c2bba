"""The registry: each backend's name, module and class, named without importing it (a run imports
only its own backend, and so only its own library: DeepSpeed for `deepspeed`, accelerate for
`accelerate`). Adding a backend is one line here and its own file.
"""

from __future__ import annotations

import importlib

from gptlite.errors import ConfigError

# The names other modules need to say: the one place a backend's name is written in Python.
# The backend a run without --backend, --deepspeed_config or --fsdp_config gets, and the one every
# other is checked against: one process, no wrapper.
REFERENCE = "single"
# The distributed baseline the tables and the projection compare with: a full replica per rank.
DDP = "ddp"
FSDP = "fsdp"
FSDP2 = "fsdp2"
# The backend --deepspeed_config (or --deepspeed) implies.
DEEPSPEED = "deepspeed"

# name -> (module, class, one line for --help)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    REFERENCE: ("backends.single", "SingleBackend", "one process, no wrapper (the reference)"),
    DDP: ("backends.ddp", "DDPBackend", "torch DistributedDataParallel (full replica per rank)"),
    "ddp_zero1": ("backends.ddp_zero1", "DDPZero1Backend",
                  "DDP with torch's ZeroRedundancyOptimizer (ZeRO-1: the optimizer state sharded over the ranks)"),
    FSDP: ("backends.fsdp", "FSDPBackend",
           "torch FullyShardedDataParallel: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, the hybrids (--fsdp_config)"),
    FSDP2: ("backends.fsdp2", "FSDP2Backend",
            "torch fully_shard (FSDP2) per block and root; HSDP mesh, reshard_after_forward (--fsdp_config)"),
    DEEPSPEED: ("backends.deepspeed", "DeepSpeedBackend",
                "DeepSpeed ZeRO 0-3, ZeRO-Offload, ZeRO-Infinity (CPU/NVMe), ZeRO++ (--deepspeed_config)"),
    "accelerate": ("backends.accelerate", "AccelerateBackend",
                   "Hugging Face accelerate's Accelerator (DDP; its FSDP or DeepSpeed plugin on GPUs)"),
}
BACKEND_NAMES: tuple[str, ...] = tuple(_REGISTRY)
BACKEND_SUMMARIES: dict[str, str] = {name: entry[2] for name, entry in _REGISTRY.items()}


def get_backend(name: str) -> type:
    """The backend class called `name` (its module is imported now)."""
    if name not in _REGISTRY:
        raise ConfigError(f"backend must be one of {', '.join(BACKEND_NAMES)} (got {name!r})")
    module, cls, _ = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def flag_owners(flag: str) -> list[str]:
    """The backends that read run flag `flag` (Backend.owned_flags), in the registry's order. Imports
    every backend's module (not its library): called where a flag is refused."""
    return [name for name in BACKEND_NAMES if flag in get_backend(name).owned_flags]


def named_alone() -> tuple[str, ...]:
    """The backends the planner runs by their name alone, no config file (Backend.planned_by_name), in the
    registry's order. Imports every backend's module."""
    return tuple(name for name in BACKEND_NAMES if get_backend(name).planned_by_name)
