"""What the torch-native backends (single, ddp, and later fsdp, fsdp2) share.

torch.optim.AdamW with the article's constants, a linear warm-up identical step by step to
DeepSpeed's WarmupLR, and mixed precision through autocast (fp32 master weights) with a gradient
scaler for fp16. A subclass only says how it wraps the model (`wrap`) and how it skips gradient
synchronisation on non-final micro-steps (`micro_step`).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from backends.activation_checkpointing import apply_ac
from backends.activation_offload import make_offloader
from backends.base import ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY, Backend, local_tensor, warmup_factor
from core import comm
from core.config import DEEPSPEED_CKPT_IMPLS, TORCH_CKPT_IMPLS
from core.memory import MemoryAccounting
from gptlite.errors import ConfigError

# DistributedDataParallel's broadcast_bucket_size: the most bytes of buffers one broadcast call carries.
BROADCAST_BUCKET = 250 * 2**20

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class TorchAccounting(MemoryAccounting):
    """A torch backend's parameters (plus any shard storage a wrapper keeps aside), their
    gradients and the optimizer's state."""

    def __init__(self, backend: "TorchBackend"):
        self.backend = backend

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        model, optimizer = self.backend.model, self.backend.optimizer
        params = list(model.parameters())
        with warnings.catch_warnings():
            # FSDP1's unsharded parameters are views (not leaves) between forward and backward: their
            # .grad is None, with a warning; their gradients live in the flat parameter's.
            warnings.simplefilter("ignore", UserWarning)
            grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        return {
            "parameter": [local_tensor(p) for p in params] + self.extra_parameter_storage(),
            "gradient": grads,
            "optimizer_state": [local_tensor(v) for state in optimizer.state.values() for v in state.values()
                                if torch.is_tensor(v)],
        }

    def extra_parameter_storage(self) -> list[torch.Tensor]:
        """Parameter storage that model.parameters() does not reach (a wrapper's own shards)."""
        return []


class TorchBackend(Backend):
    # Mixed precision by autocast over fp32 weights; backends that cast the module's parameters
    # themselves (FSDP's MixedPrecision, FSDP2's policy, accelerate's prepared model) turn it off.
    uses_autocast = True

    @classmethod
    def resolve(cls, cfg, env):
        if cfg.ckpt_impl in DEEPSPEED_CKPT_IMPLS:
            raise ConfigError(f"ckpt_impl {cfg.ckpt_impl} needs the deepspeed backend; "
                              f"backend {cls.name} supports {', '.join(TORCH_CKPT_IMPLS)}")
        return super().resolve(cfg, env)

    def setup(self, model: nn.Module) -> None:
        blocks = self.prepare_blocks(model)  # before wrapping: the wrappers' hooks stay outside compiled code
        self.offloader = make_offloader(self.cfg, self.env.device, model, blocks)
        # A model still on the meta device (a checkpoint FSDP2 loads shard by shard) gets storage in wrap.
        on_meta = any(p.is_meta for p in model.parameters())
        self.model = self.wrap(model if on_meta else model.to(self.env.device))
        # After wrapping, as the FSDP tutorial does; see backends/activation_checkpointing.py.
        self.activation_checkpointing = apply_ac(
            self.model, blocks, self.cfg.ckpt_interval, self.cfg.ckpt_impl, self.cfg.ckpt_offload,
            offloader=self.offloader, policy=self.cfg.ckpt_policy, save_ops=self.cfg.save_ops(),
            choices=self.cfg.ckpt_choices(len(blocks)) if self.cfg.ckpt_plan is not None else None)
        self.optimizer = self.build_optimizer(self.model.parameters())
        warmup = self.cfg.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: warmup_factor(s, warmup))
        self.autocast_dtype = AUTOCAST_DTYPES[self.cfg.precision] if self.uses_autocast else None
        self.scaler = self.build_scaler(enabled=self.cfg.precision == "fp16")

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as this backend trains it (already on the device)."""
        return model

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        params = list(params)
        # Fused (one kernel for every parameter) where every parameter is on a GPU: the fastest
        # AdamW torch has there. Host-resident parameters (CPU runs, CPU offload) keep the default
        # implementation, so CPU results are unchanged.
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
        return torch.optim.AdamW(params, lr=self.cfg.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY,
                                 fused=True if fused else None)

    def build_scaler(self, enabled: bool):
        return torch.amp.GradScaler(self.env.device.type, enabled=enabled)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.env.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            _, loss = self.model(x, y)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        # Each micro-batch's loss is a mean over its samples; dividing by the number of
        # micro-steps makes the accumulated gradient the mean over the rank's whole batch.
        self.scaler.scale(loss / self.cfg.grad_accum).backward()

    def step(self) -> None:
        if self.cfg.grad_clip:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the loss-scaled ones
            self.clip_grad_norm(self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def clip_grad_norm(self, max_norm: float) -> None:
        """Scale the gradients so that their global norm (over every rank) is at most max_norm."""
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def accounting(self) -> MemoryAccounting:
        return TorchAccounting(self)

    def unwrapped(self) -> nn.Module:
        """The model without the data-parallel wrapper (checkpoint wrappers strip their own
        prefixes from state dicts)."""
        return getattr(self.model, "module", self.model)

    def save_checkpoint(self, directory: Path) -> None:
        if self.env.is_main:  # every rank holds the same state: one copy
            directory.mkdir(parents=True, exist_ok=True)
            torch.save({"model": self.unwrapped().state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()},
                       directory / "state.pt")

    def load_checkpoint(self, directory: Path) -> None:
        state = torch.load(directory / "state.pt", map_location=self.env.device, weights_only=True)
        self.unwrapped().load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])

    def teardown(self) -> None:
        self.model = self.optimizer = self.scheduler = self.scaler = None

    def comm_theory(self, n_params: int, trainable: int | None = None, buffers: dict | None = None) -> dict:
        """A full replica per rank (DDP, and accelerate's DDP): the gradients all-reduced once a
        step, in their own dtype (fp32 under autocast): 2 Psi (N-1)/N on the bus, Psi the trainable
        parameters (DDP buckets only those); and the model's buffers, where it has any, broadcast
        from rank 0 (DistributedDataParallel's broadcast_buffers, on by default) before the forward
        of each step's first micro-step (the later ones run under no_sync, which skips it)."""
        n = self.env.world_size
        if n == 1 or self.name == "single":
            return super().comm_theory(n_params, trainable, buffers)
        grads = n_params if trainable is None else trainable
        terms = {"all_reduce": (grads, 4, n)}
        formula = "all-reduce of the gradients: 2 Psi (N-1)/N"
        if buffers and sum(buffers.values()):
            terms["broadcast"] = (sum(buffers.values()), 1, n)
            formula += "; the buffers broadcast from rank 0"
        return comm.theory(formula, terms, n, self.env.local_world_size)

    def comm_schedule(self, param_sizes: list[int], buffers: dict | None = None) -> dict[str, tuple[float | None, float]]:
        """The buffers' broadcast (comm_theory), where the model has buffers: one call per dtype
        (torch's broadcast_coalesced groups tensors by type) and per BROADCAST_BUCKET of it, all of
        it waiting: it runs before the forward, and the forward waits for it."""
        if "broadcast" not in self.comm_theory(0, 0, buffers)["by_kind"]:  # one replica, no buffers, FSDP2
            return {}
        calls = sum(math.ceil(b / BROADCAST_BUCKET) for b in buffers.values() if b)
        return {"broadcast": (sum(buffers.values()) / calls, 1.0)}

    def describe(self) -> dict:
        compute = {"fp32": "fp32", "bf16": "bf16 (autocast)", "fp16": "fp16 (autocast)"}[self.cfg.precision]
        return {
            "name": self.name,
            "activation_checkpointing": self.activation_checkpointing,
            "compile": self.compiled,
            "optimizer": "torch.optim.AdamW (fused)" if self.optimizer.defaults.get("fused") else "torch.optim.AdamW",
            "master_dtype": "fp32",
            "compute_dtype": compute,
            "reduce_dtype": "fp32",
            "loss_scaling": "dynamic (torch.amp.GradScaler)" if self.cfg.precision == "fp16" else None,
        }
