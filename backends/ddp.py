"""`ddp`: torch DistributedDataParallel. Every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from backends.memory_layout import Layout
from backends.torch_backend import TorchBackend
from core.dist import fake_world_allreduce_hook, is_fake_process_group
from gptlite.errors import ConfigError

MiB = 2**20
DEFAULT_BUCKET_MIB = 25  # DistributedDataParallel's bucket_cap_mb when none is given


def buckets(param_sizes: list[int], first: float, cap: float) -> list[int]:
    """The bytes of each of DDP's buckets, in the order they are all-reduced, for fp32 gradients of
    `param_sizes` elements in the model's order: torch's own assignment (the one DDP's reducer rebuilds
    its buckets with, on the gradients in the order they became ready: backward's, the parameters in
    reverse), a bucket closed once it holds its limit or more, `first` for the first and `cap` for
    every later one, a tensor never split. On meta tensors: nothing allocated."""
    grads = [torch.empty(n, device="meta") for n in reversed(param_sizes)]
    if not grads:
        return []
    indices, _ = dist._compute_bucket_assignment_by_size(grads, [int(first), int(cap)], [False] * len(grads))
    return [sum(grads[i].numel() * grads[i].element_size() for i in bucket) for bucket in indices]


class _DDP(DistributedDataParallel):
    """DistributedDataParallel whose forward says in one line (ConfigError) what torch's reducer says in a
    paragraph when a step left parameters without a gradient and find_unused_parameters is off: the model's
    conditional computation that the pre-training check (training/run.py check_unused) did not see."""

    def _get_name(self) -> str:  # printed as torch's
        return "DistributedDataParallel"

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as e:
            if "Expected to have finished reduction in the prior iteration" not in str(e):
                raise
            raise ConfigError("ddp: the last step left parameters without a gradient (conditional computation the "
                              "check before training did not see: experts that got no token, a branch these samples "
                              "skip); give --find_unused_parameters (DDP's own setting)") from None


class DDPBackend(TorchBackend):
    name = "ddp"
    owned_flags = ("ddp_bucket_cap_mb", "find_unused_parameters")
    projected_by_name = planned_by_name = True

    @classmethod
    def planner_variants(cls, options):
        """Named alone: its buckets a quarter and four times its default, train.py flags (more calls and less
        waiting after backward, or fewer and more: comm_schedule); where it reads the flag (not ddp_zero1)."""
        if options is not None or "ddp_bucket_cap_mb" not in cls.owned_flags:
            return []
        return [(f"buckets_{name}", {"ddp_bucket_cap_mb": DEFAULT_BUCKET_MIB * f}) for name, f in (("quarter", 0.25),
                                                                                                 ("x4", 4))]

    @classmethod
    def memory_layout(cls, world, precision, options=None, ranks_per_node=None) -> Layout:
        # A full replica, the gradients views into DDP's buckets (gradient_as_bucket_view), autocast.
        return Layout("replicated", ddp_bucket=True, autocast=True)

    @classmethod
    def resolve(cls, cfg, env):
        resolved = super().resolve(cfg, env)  # a backend that does not own --ddp_bucket_cap_mb refuses it first
        cap = cfg.ddp_bucket_cap_mb
        if cap is not None and not math.isfinite(cap):
            raise ConfigError(f"ddp_bucket_cap_mb must be a finite number (got {cap})")
        if cap is not None and not cap > 0:
            raise ConfigError(f"ddp_bucket_cap_mb must be > 0 (got {cap})")
        return resolved

    @classmethod
    def check_unused_parameters(cls, cfg, what: str) -> None:
        if cfg.find_unused_parameters:
            return  # a parameter no rank used then keeps no gradient, and AdamW skips it, as in one process
        raise ConfigError(f"{what}; DDP waits for every gradient: give --find_unused_parameters (DDP's own setting; "
                          "a parameter no rank used then gets no update, as in one process)")

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        # Gradients as views into the all-reduce buckets: one copy of the gradients, not two. No
        # --ddp_bucket_cap_mb passes None, not 25: DDP keeps its small first bucket only by default.
        ddp = _DDP(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                      bucket_cap_mb=self.cfg.ddp_bucket_cap_mb,
                                      find_unused_parameters=self.cfg.find_unused_parameters)
        if is_fake_process_group():
            ddp.register_comm_hook(None, fake_world_allreduce_hook)
        return ddp

    def micro_step(self, sync: bool):
        return super().micro_step(sync) if sync else self.model.no_sync()

    def bucket_limits(self) -> tuple[float, float]:
        """(the first bucket's bytes, every later bucket's): DDP's 1 MiB then 25 MiB by default, else
        --ddp_bucket_cap_mb for all."""
        if self.cfg.ddp_bucket_cap_mb is None:
            return float(dist._DEFAULT_FIRST_BUCKET_BYTES), DEFAULT_BUCKET_MIB * MiB
        return (self.cfg.ddp_bucket_cap_mb * MiB,) * 2

    def comm_schedule(self, param_sizes: list[int], buffers: dict | None = None) -> dict[str, tuple[float | None, float]]:
        """DDP's buckets (buckets(), bucket_limits()) over the gradients, fp32 (comm_theory): the bytes of a call are
        their mean; the last bucket, the first layers' gradients, is ready only when backward ends
        and waits (its share of the bytes). These are the buckets of every step after the first:
        torch 2.x reduces the first step's gradients as one bucket, then rebuilds its buckets in the
        order the gradients became ready, for a model whose layers run in order the parameters in
        reverse (checked equal to DDP's rebuilt buckets for GPT-lite tiny and small at 1+25, 0.1,
        6.25 and 100 MiB, 2026-11-26). The buffers' broadcast as TorchBackend's."""
        sizes = buckets(param_sizes, *self.bucket_limits())
        reduce = {"all_reduce": (sum(sizes) / len(sizes), sizes[-1] / sum(sizes))} if sizes else {}
        return {**super().comm_schedule(param_sizes, buffers), **reduce}

    def describe(self) -> dict:
        first, cap = self.bucket_limits()
        return {**super().describe(), "wrapper": "DistributedDataParallel", "gradient_as_bucket_view": True,
                "bucket_mib": cap / MiB, "first_bucket_mib": first / MiB,
                "find_unused_parameters": self.cfg.find_unused_parameters}
