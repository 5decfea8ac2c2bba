"""`ddp`: torch DistributedDataParallel. Every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from backends.torch_backend import TorchBackend
from core.dist import fake_world_allreduce_hook, is_fake_process_group


class DDPBackend(TorchBackend):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        # Gradients as views into the all-reduce buckets: one copy of the gradients, not two.
        ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        if is_fake_process_group():
            ddp.register_comm_hook(None, fake_world_allreduce_hook)
        return ddp

    def micro_step(self, sync: bool):
        return super().micro_step(sync) if sync else self.model.no_sync()

    def describe(self) -> dict:
        return {**super().describe(), "wrapper": "DistributedDataParallel", "gradient_as_bucket_view": True}
