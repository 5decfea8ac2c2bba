"""Backends by name. Each is one file implementing backends.base.Backend.

The registry (backends/registry.py) names each backend's module without importing it: a run imports
only its own backend (and so only its own library: DeepSpeed for `deepspeed`, accelerate for
`accelerate`). `resolve` turns a run configuration into the backend class, the completed configuration and the
backend's frozen plan, reading a backend's config file exactly once.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from backends.registry import (BACKEND_NAMES, BACKEND_SUMMARIES, DDP, DEEPSPEED, FSDP, FSDP2, REFERENCE, flag_owners,
                               get_backend, named_alone)

if TYPE_CHECKING:
    from backends.base import Resolved
    from core.config import RunConfig
    from core.dist import DistEnv


def resolve(cfg: RunConfig, env: DistEnv) -> Resolved:
    """The backend a run names or implies, its completed configuration and its spec.

    Without --backend: DeepSpeed for --deepspeed_config, the file's own `backend:` for
    --fsdp_config (read here once and handed to the backend), else single.
    """
    if cfg.backend is None and cfg.fsdp_config is not None and cfg.deepspeed_config is None:
        from backends import fsdp_config  # torch: the names above stay importable without it

        options = fsdp_config.load(cfg.fsdp_config)
        return get_backend(options.backend).resolve(dataclasses.replace(cfg, backend=options.backend), env,
                                                    options=options)
    name = cfg.backend or (DEEPSPEED if cfg.deepspeed_config is not None or cfg.deepspeed else REFERENCE)
    return get_backend(name).resolve(dataclasses.replace(cfg, backend=name), env)


def named_by(cfg: RunConfig) -> str:
    """The name of the backend `resolve` picks for `cfg` (an --fsdp_config file's `backend:` read where it
    decides), without resolving it."""
    if cfg.backend is None and cfg.fsdp_config is not None and cfg.deepspeed_config is None:
        from backends import fsdp_config  # torch: as in resolve

        return fsdp_config.load(cfg.fsdp_config).backend
    return cfg.backend or (DEEPSPEED if cfg.deepspeed_config is not None or cfg.deepspeed else REFERENCE)


__all__ = ["BACKEND_NAMES", "BACKEND_SUMMARIES", "DDP", "DEEPSPEED", "FSDP", "FSDP2", "REFERENCE", "flag_owners",
           "get_backend", "named_alone", "named_by", "resolve"]
