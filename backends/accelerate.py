"""`accelerate`: Hugging Face accelerate's Accelerator driving the training step.

`--accelerate_plugin none` (default): Accelerator-managed DistributedDataParallel, on CPU (gloo) and
GPU; `fsdp` or `deepspeed`: accelerate's FullyShardedDataParallelPlugin or DeepSpeedPlugin, where
the installed accelerate supports the device. On CPU it supports neither: accelerate 1.15 turns
FSDP on only for GPU distributed types (on CPU the plugin is silently ignored and the model comes
back DDP-wrapped), and its DeepSpeed plugin needs transformers; both are refused on CPU with a
one-line error rather than run as something else.

Three of accelerate's defaults would silently change the training, so the backend sets them:
- Accelerator(cpu=True) on a CPU-only machine: without it every rank trains alone on its batch;
- the LR scheduler is not passed to prepare(): accelerate's wrapper steps it once per process per
  optimizer step;
- fp16 on CPU is refused: accelerate would run it as fp32 without saying so.
The process group is created by the suite beforehand (core/dist.py), which Accelerator accepts.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from backends.memory_layout import Layout
from backends.torch_backend import TorchBackend
from core.dist import fake_world_allreduce_hook, is_fake_process_group
from gptlite.errors import ConfigError

PLUGINS = ("none", "fsdp", "deepspeed")


class AccelerateBackend(TorchBackend):
    name = "accelerate"
    owned_flags = ("accelerate_plugin",)

    @classmethod
    def fake_world_growth(cls, cfg) -> tuple[str, str]:
        if cfg.accelerate_plugin == "none":
            return cls.fake_world_family, cls.name
        return ("sharded_blocks", "accelerate's FSDP") if cfg.accelerate_plugin == "fsdp" else \
            ("zero3", "accelerate's DeepSpeed")

    @classmethod
    def memory_layout(cls, world, precision, options=None, ranks_per_node=None) -> Layout:
        # accelerate's Accelerator runs DDP underneath, without gradients as views of its buckets.
        return Layout("replicated", ddp_bucket=True, grads_beside_buckets=True, autocast=True)
    uses_autocast = False  # the prepared model autocasts itself

    @classmethod
    def resolve(cls, cfg, env):
        if cfg.accelerate_plugin != "none" and env.device.type == "cpu":
            reason = ("turns FSDP on only for GPU distributed types (on CPU it would silently run DDP)"
                      if cfg.accelerate_plugin == "fsdp" else "needs transformers and a GPU accelerator state")
            raise ConfigError(f"accelerate_plugin {cfg.accelerate_plugin}: accelerate's plugin {reason}; on CPU "
                              f"use --accelerate_plugin none, or --backend {'fsdp' if cfg.accelerate_plugin == 'fsdp' else 'deepspeed'}")
        if cfg.precision == "fp16" and env.device.type == "cpu":
            raise ConfigError("precision fp16 with the accelerate backend on CPU: accelerate runs it as fp32 "
                              "without saying so; use bf16 or fp32")
        return super().resolve(cfg, env)

    def setup(self, model: nn.Module) -> None:
        from accelerate import Accelerator

        kwargs = {}
        if self.cfg.accelerate_plugin == "fsdp":
            from accelerate import FullyShardedDataParallelPlugin

            kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
        elif self.cfg.accelerate_plugin == "deepspeed":
            from accelerate import DeepSpeedPlugin

            kwargs["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=2, gradient_clipping=self.cfg.grad_clip)
        self.accelerator = Accelerator(
            cpu=self.env.device.type == "cpu",
            mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[self.cfg.precision],
            gradient_accumulation_steps=self.cfg.grad_accum, **kwargs)
        if self.accelerator.num_processes != dist.get_world_size():
            raise RuntimeError(f"accelerate sees {self.accelerator.num_processes} processes, the launcher started "
                               f"{dist.get_world_size()}")
        super().setup(model)
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        if is_fake_process_group() and isinstance(self.model, DistributedDataParallel):
            self.model.register_comm_hook(None, fake_world_allreduce_hook)

    def build_scaler(self, enabled: bool):
        return torch.amp.GradScaler(self.env.device.type, enabled=False)  # accelerate scales fp16 itself

    def micro_step(self, sync: bool):
        return contextlib.nullcontext() if sync else self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)  # divides by gradient_accumulation_steps itself

    def clip_grad_norm(self, max_norm: float) -> None:
        self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self) -> None:
        if self.cfg.grad_clip:
            self.clip_grad_norm(self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def describe(self) -> dict:
        return {**super().describe(), "wrapper": type(self.model).__name__,
                "accelerate_plugin": self.cfg.accelerate_plugin,
                "distributed_type": str(self.accelerator.distributed_type)}

    def teardown(self) -> None:
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None:
            from accelerate.state import AcceleratorState, GradientState

            accelerator.free_memory()
            # accelerate's state is a process-wide singleton: reset it for the next run in this process.
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
        self.accelerator = None
        super().teardown()
