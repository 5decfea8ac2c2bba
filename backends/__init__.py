"""Backends by name. Each is one file implementing backends.base.Backend."""

from __future__ import annotations

from backends.accelerate import AccelerateBackend
from backends.base import Backend
from backends.ddp import DDPBackend
from backends.deepspeed import DeepSpeedBackend
from backends.fsdp import FSDPBackend
from backends.fsdp2 import FSDP2Backend
from backends.single import SingleBackend

BACKENDS: dict[str, type[Backend]] = {
    cls.name: cls
    for cls in (SingleBackend, DDPBackend, FSDPBackend, FSDP2Backend, DeepSpeedBackend, AccelerateBackend)
}


def get_backend(name: str) -> type[Backend]:
    return BACKENDS[name]


__all__ = ["BACKENDS", "Backend", "get_backend"]
