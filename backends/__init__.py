"""Backends by name. Each is one file implementing backends.base.Backend.

The registry names each backend's module without importing it: a run imports only its own
backend (and so only its own library: DeepSpeed for `deepspeed`, accelerate for `accelerate`).
`resolve` turns a run configuration into the backend class, the completed configuration and the
backend's frozen plan, reading a backend's config file exactly once.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

from gptlite.errors import ConfigError

if TYPE_CHECKING:
    from backends.base import Backend, Resolved
    from core.config import RunConfig
    from core.dist import DistEnv

# name -> (module, class, one line for --help)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "single": ("backends.single", "SingleBackend", "one process, no wrapper (the reference)"),
    "ddp": ("backends.ddp", "DDPBackend", "torch DistributedDataParallel (full replica per rank)"),
    "fsdp": ("backends.fsdp", "FSDPBackend",
             "torch FullyShardedDataParallel: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, the hybrids (--fsdp_config)"),
    "fsdp2": ("backends.fsdp2", "FSDP2Backend",
              "torch fully_shard (FSDP2) per block and root; HSDP mesh, reshard_after_forward (--fsdp_config)"),
    "deepspeed": ("backends.deepspeed", "DeepSpeedBackend",
                  "DeepSpeed ZeRO 0-3, ZeRO-Offload, ZeRO-Infinity (CPU/NVMe), ZeRO++ (--deepspeed_config)"),
    "accelerate": ("backends.accelerate", "AccelerateBackend",
                   "Hugging Face accelerate's Accelerator (DDP; its FSDP or DeepSpeed plugin on GPUs)"),
}
BACKEND_NAMES: tuple[str, ...] = tuple(_REGISTRY)
# The backend a run without --backend, --deepspeed_config or --fsdp_config gets, and the one every
# other is checked against: one process, no wrapper.
REFERENCE = "single"
# The backend --deepspeed_config (or --deepspeed) implies.
DEEPSPEED = "deepspeed"
BACKEND_SUMMARIES: dict[str, str] = {name: entry[2] for name, entry in _REGISTRY.items()}


def get_backend(name: str) -> type[Backend]:
    """The backend class called `name` (its module is imported now)."""
    if name not in _REGISTRY:
        raise ConfigError(f"backend must be one of {', '.join(BACKEND_NAMES)} (got {name!r})")
    module, cls, _ = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def resolve(cfg: RunConfig, env: DistEnv) -> Resolved:
    """The backend a run names or implies, its completed configuration and its plan.

    Without --backend: DeepSpeed for --deepspeed_config, the file's own `backend:` for
    --fsdp_config (read here once and handed to the backend), else single.
    """
    if cfg.backend is None and cfg.fsdp_config is not None and cfg.deepspeed_config is None:
        from backends import fsdp_config

        options = fsdp_config.load(cfg.fsdp_config)
        return get_backend(options.backend).resolve(dataclasses.replace(cfg, backend=options.backend), env,
                                                    options=options)
    name = cfg.backend or (DEEPSPEED if cfg.deepspeed_config is not None or cfg.deepspeed else REFERENCE)
    return get_backend(name).resolve(dataclasses.replace(cfg, backend=name), env)


__all__ = ["BACKEND_NAMES", "BACKEND_SUMMARIES", "DEEPSPEED", "REFERENCE", "get_backend", "resolve"]
