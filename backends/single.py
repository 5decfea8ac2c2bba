"""`single`: one process, the model unwrapped. The reference every other backend is checked against."""

from __future__ import annotations

from backends.torch_backend import TorchBackend
from gptlite.errors import ConfigError
from core.dist import DistEnv


class SingleBackend(TorchBackend):
    name = "single"
    needs_process_group = False

    @classmethod
    def resolve(cls, cfg, env: DistEnv):
        if env.world_size != 1:
            raise ConfigError(
                f"backend single runs in one process (got WORLD_SIZE={env.world_size}); "
                "launch it with plain python, or use a distributed backend such as ddp")
        return super().resolve(cfg, env)
