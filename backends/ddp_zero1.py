"""`ddp_zero1`: DDP with torch's ZeroRedundancyOptimizer (ZeRO-1 in torch). Every rank holds the whole
model and its gradients, all-reduced by DistributedDataParallel as under `ddp`; the AdamW state is
sharded: each rank owns the parameters ZeroRedundancyOptimizer assigns it, steps only those, and
broadcasts them to the others after its step (torch.distributed.optim.ZeroRedundancyOptimizer).

    torchrun --nproc_per_node 2 train.py --backend ddp_zero1
"""

from __future__ import annotations

from pathlib import Path

import torch

from backends.base import ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY, Backend, local_tensor
from backends.ddp import DDPBackend
from backends.memory_layout import Layout
from backends.torch_backend import TorchAccounting
from core import comm
from core.memory import MemoryAccounting


class _ShardedStateAccounting(TorchAccounting):
    """The optimizer state this rank owns: ZeroRedundancyOptimizer's local optimizer's."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = super().state_tensors()
        local = self.backend.optimizer.optim
        tensors["optimizer_state"] = [local_tensor(v) for state in local.state.values() for v in state.values()
                                      if torch.is_tensor(v)]
        return tensors


class DDPZero1Backend(DDPBackend):
    name = "ddp_zero1"
    # DDP's own flags stay ddp's: this backend runs DDP's defaults (its buckets, every parameter used).
    owned_flags = ()
    planned_by_name = False

    @classmethod
    def memory_layout(cls, world, precision, options=None, ranks_per_node=None) -> Layout:
        # DDP's layout, the Adam state (and step counters) of 1/world of the parameters per rank.
        return Layout("replicated", ddp_bucket=True, autocast=True, optimizer_shards=world)

    @classmethod
    def check_unused_parameters(cls, cfg, what: str) -> None:
        # --find_unused_parameters is ddp's own option: refused here as under the sharding backends.
        Backend.check_unused_parameters.__func__(cls, cfg, what)

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        # torch's AdamW as every torch backend runs it, stepped on this rank's shard only.
        from torch.distributed.optim import ZeroRedundancyOptimizer  # 0.8 s: see tests/unit/test_structure.py

        return ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.AdamW, lr=self.cfg.lr,
                                       betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)

    def accounting(self) -> MemoryAccounting:
        return _ShardedStateAccounting(self)

    def save_checkpoint(self, directory: Path) -> None:
        # Collective: every rank sends its shard of the optimizer state to rank 0, which writes it whole.
        self.optimizer.consolidate_state_dict(to=0)
        super().save_checkpoint(directory)

    def comm_theory(self, n_params: int, trainable: int | None = None, buffers: dict | None = None) -> dict:
        """DDP's all-reduce of the gradients and broadcast of the buffers (TorchBackend), and each
        owner's updated parameters broadcast to every rank after the step: Psi fp32 elements."""
        n = self.env.world_size
        if n == 1:
            return super().comm_theory(n_params, trainable, buffers)
        grads = n_params if trainable is None else trainable
        broadcast = 4 * grads + sum((buffers or {}).values())  # bytes, as TorchBackend counts the buffers'
        return comm.theory("all-reduce of the gradients: 2 Psi (N-1)/N; each rank's updated parameters "
                           "(and the buffers) broadcast from their owner", {"all_reduce": (grads, 4, n),
                                                                            "broadcast": (broadcast, 1, n)},
                           n, self.env.local_world_size)

    def describe(self) -> dict:
        return {**super().describe(), "optimizer": "torch.distributed.optim.ZeroRedundancyOptimizer(torch.optim.AdamW)",
                "optimizer_state": f"sharded over {self.env.world_size} ranks"}
