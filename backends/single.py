"""`single`: one process, the model unwrapped. The reference every other backend is checked against."""

from __future__ import annotations

from backends.memory_layout import Layout
from backends.torch_backend import TorchBackend
from gptlite.errors import ConfigError
from core.dist import DistEnv


class SingleBackend(TorchBackend):
    name = "single"
    needs_process_group = False
    launcher = "python"
    one_process = True
    planned_by_name = True

    @classmethod
    def resolve(cls, cfg, env: DistEnv):
        if env.world_size != 1:
            raise ConfigError(
                f"backend single runs in one process (got WORLD_SIZE={env.world_size}); "
                "launch it with plain python, or use a distributed backend such as ddp")
        return super().resolve(cfg, env)

    @classmethod
    def memory_layout(cls, world, precision, options=None, ranks_per_node=None) -> Layout:
        # Mixed precision as autocast over fp32 weights (backends/torch_backend.py).
        return Layout("replicated", autocast=True)

    @classmethod
    def check_unused_parameters(cls, cfg, what: str) -> None:
        return None  # one process: a parameter no sample used gets no gradient and no update
