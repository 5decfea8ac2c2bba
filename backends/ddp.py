"""`ddp`: torch DistributedDataParallel. Every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from backends.torch_backend import TorchBackend
from core.dist import fake_world_allreduce_hook, is_fake_process_group

MiB = 2**20
DEFAULT_BUCKET_MIB = 25  # DistributedDataParallel's bucket_cap_mb when none is given


class DDPBackend(TorchBackend):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        # Gradients as views into the all-reduce buckets: one copy of the gradients, not two. No
        # --ddp_bucket_cap_mb passes None, not 25: DDP keeps its small first bucket only by default.
        ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                      bucket_cap_mb=self.cfg.ddp_bucket_cap_mb)
        if is_fake_process_group():
            ddp.register_comm_hook(None, fake_world_allreduce_hook)
        return ddp

    def micro_step(self, sync: bool):
        return super().micro_step(sync) if sync else self.model.no_sync()

    def buckets(self) -> tuple[float, float]:
        """(the first bucket's bytes, every later bucket's): DDP's 1 MiB then 25 MiB by default, else
        --ddp_bucket_cap_mb for all."""
        if self.cfg.ddp_bucket_cap_mb is None:
            return float(dist._DEFAULT_FIRST_BUCKET_BYTES), DEFAULT_BUCKET_MIB * MiB
        return (self.cfg.ddp_bucket_cap_mb * MiB,) * 2

    def comm_schedule(self, n_params: int) -> dict[str, tuple[float | None, float]]:
        """Buckets fill in backward's order, the last layers' first, and each is all-reduced once full:
        the last one, the first layers' gradients (what is left after the first bucket and the full
        ones), is ready only when backward ends, and waits. Its share of the bytes, by the bytes (a
        parameter is not split between buckets: a bound, not the exact cut)."""
        theory = self.comm_theory(n_params)["by_kind"]
        if "all_reduce" not in theory:
            return {}
        total = theory["all_reduce"]["bytes"]
        first, cap = self.buckets()
        rest = total - first
        last = total if rest <= 0 else (rest % cap or cap)
        return {"all_reduce": (cap, min(1.0, last / total))}

    def describe(self) -> dict:
        first, cap = self.buckets()
        return {**super().describe(), "wrapper": "DistributedDataParallel", "gradient_as_bucket_view": True,
                "bucket_mib": cap / MiB, "first_bucket_mib": first / MiB}
