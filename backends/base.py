"""The Backend interface: everything the training loop needs from a way of training.

The loop (training/loop.py) never branches on the backend. For each optimizer step it calls:

    for each micro-step m of grad_accum:
        with backend.micro_step(sync=(m is the last)):
            loss = backend.forward(x, y)      # mean loss of this micro-batch
            backend.backward(loss)
    backend.step()

A backend owns the wrapped model, the optimizer, the learning-rate schedule and the precision
handling, and reports what it holds per rank (`model_state_bytes`) and how it is set up
(`describe`, recorded in the run's config.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn as nn

from training.dist import DistEnv, init_process_group
from training.memory import storage_roles

if TYPE_CHECKING:  # training.config imports the backend registry
    from training.config import RunConfig

# The article's DeepSpeed optimizer, used by every backend: AdamW with these constants.
ADAM_BETAS = (0.8, 0.999)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 3e-7


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based) is lr * this.

    Exactly DeepSpeed's WarmupLR with warmup_type "linear" as its engine drives it, so torch and
    DeepSpeed backends follow the same schedule step by step: the scheduler starts at iteration
    -1 (lr = min_lr = 0) and is stepped after each optimizer step, so step s runs at iteration
    s - 1, with factor (s - 1) / W until W (at least 2). 0 turns warm-up off.
    """
    if warmup_steps <= 0:
        return 1.0
    iteration, warmup = step - 1, max(2, warmup_steps)
    if iteration < 0:
        return 0.0
    return iteration / warmup if iteration < warmup else 1.0


class Backend(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]  # one line for --help
    # Whether the backend needs a torch.distributed process group (even for a world of one).
    needs_process_group: ClassVar[bool] = True
    # How save_checkpoint writes: "torch" (state dicts), "dcp" (torch.distributed.checkpoint) or
    # "deepspeed" (the engine's own); training/export.py reads each back into one state dict.
    checkpoint_format: ClassVar[str] = "torch"

    def __init__(self, cfg: RunConfig, env: DistEnv):
        self.cfg = cfg
        self.env = env
        self.model: nn.Module | None = None

    @classmethod
    def resolve(cls, cfg: RunConfig, env: DistEnv) -> RunConfig:
        """`cfg` with this backend's defaults filled in (precision, config files read).

        Raises ConfigError for what this backend cannot run (world size, options); called before
        any process group exists, so bad input fails fast with a one-line error.
        """
        from training.config import (DEFAULT_GRAD_ACCUM, DEFAULT_GRAD_CLIP, DEFAULT_LR, DEFAULT_LR_WARMUP_STEPS,
                                     DEFAULT_MICRO_BATCH)

        def default(value, fallback):
            return fallback if value is None else value

        return dataclasses.replace(
            cfg,
            precision=default(cfg.precision, "fp32"),
            micro_batch=default(cfg.micro_batch, DEFAULT_MICRO_BATCH),
            grad_accum=default(cfg.grad_accum, DEFAULT_GRAD_ACCUM),
            lr=default(cfg.lr, DEFAULT_LR),
            lr_warmup_steps=default(cfg.lr_warmup_steps, DEFAULT_LR_WARMUP_STEPS),
            grad_clip=default(cfg.grad_clip, DEFAULT_GRAD_CLIP),
        )

    @classmethod
    def init_distributed(cls, env: DistEnv, timeout_s: float) -> None:
        """Create the process group this backend communicates over."""
        init_process_group(env, timeout_s)

    @abstractmethod
    def setup(self, model: nn.Module) -> None:
        """Wrap `model` (on the CPU, fp32, identical on every rank) and build the optimizer."""

    def micro_step(self, sync: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step's forward and backward; sync=False skips gradient sync."""
        return contextlib.nullcontext()

    @abstractmethod
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of micro-batch (x, y), a scalar that `backward` accepts."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of `loss`, scaled for gradient accumulation."""

    @abstractmethod
    def step(self) -> None:
        """Optimizer step, gradient reset and learning-rate schedule step."""

    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next `step` applies."""

    @abstractmethod
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's model state as it is right now, by role: "parameter", "gradient",
        "optimizer_state" (local shards; views and aliases are fine, storage is counted once)."""

    # Unsharded parameters a sharded backend holds from forward until backward frees them: measured
    # by a forward hook, armed by the loop for the last step only (model_state_bytes reads it).
    _gathered_bytes = 0
    _gathered_hook = None

    def measure_gathered(self) -> int:
        """Unsharded parameter bytes allocated right now (sharded backends override)."""
        return 0

    def gathered_root(self) -> nn.Module:
        """The module whose forward hook sees the parameters still gathered."""
        return self.model

    def watch_gathered_params(self) -> None:
        """From now on, measure after each forward what `measure_gathered` reports."""
        if self._gathered_hook is None and type(self).measure_gathered is not Backend.measure_gathered:
            def hook(module, args, output):
                self._gathered_bytes = self.measure_gathered()

            self._gathered_hook = self.gathered_root().register_forward_hook(hook)

    def gathered_param_bytes(self) -> int:
        """Unsharded parameter bytes still allocated after the last watched forward."""
        return self._gathered_bytes

    def memory_roles(self) -> dict[int, tuple[str, int, str]]:
        """The storages of `state_tensors`, for the memory breakdown (training.memory)."""
        return storage_roles(self.state_tensors())

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds: see runs/README.md, `model_state_bytes`.

        Called by the loop after the last backward of a step, before `step`, so gradients exist.
        """
        out = {"params": 0, "params_gathered": self.gathered_param_bytes(), "grads": 0, "optimizer": 0,
               "offloaded": 0}
        field = {"parameter": "params", "gradient": "grads", "optimizer_state": "optimizer"}
        tensors = self.state_tensors()
        for role, size, device in storage_roles(tensors).values():
            out[field[role]] += size
        if self.env.device.type != "cpu":
            # Host-resident state; 0-dim tensors are host scalars (AdamW's step counters), not offload.
            host = {role: [t for t in ts if t is not None and t.device.type == "cpu" and t.dim() > 0]
                    for role, ts in tensors.items()}
            out["offloaded"] = sum(size for _, size, _ in storage_roles(host).values())
        return out

    @abstractmethod
    def save_checkpoint(self, directory: Path) -> None:
        """Write model, optimizer, LR schedule (and loss scaler) state under `directory`.

        Collective: every rank calls it. The loop saves the step and the RNG states itself.
        """

    @abstractmethod
    def load_checkpoint(self, directory: Path) -> None:
        """Restore what save_checkpoint wrote (after setup, before the first step)."""

    def eval_mode(self) -> contextlib.AbstractContextManager:
        """Context for evaluation: no grad, dropout off, training mode restored after."""
        return _EvalMode(self.model)

    def describe(self) -> dict:
        """How this backend is set up, for the run record (wrapper, dtypes, sharding, ...)."""
        return {"name": self.name}

    def teardown(self) -> None:
        """Release what setup built (hooks, engines, background threads)."""


class _EvalMode(contextlib.ContextDecorator):
    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.was_training = self.model.training
        self.model.eval()
        self.no_grad = torch.no_grad()
        self.no_grad.__enter__()

    def __exit__(self, *exc):
        self.no_grad.__exit__(*exc)
        self.model.train(self.was_training)
        return False


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` stored on this rank (a DTensor's local shard, else the tensor)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
