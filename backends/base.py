"""The Backend interface: everything the training loop needs from a way of training.

The loop (training/loop.py) never branches on the backend. For each optimizer step it calls:

    for each micro-step m of grad_accum:
        with backend.micro_step(sync=(m is the last)):
            loss = backend.forward(x, y)      # mean loss of this micro-batch
            backend.backward(loss)
    backend.step()

A backend owns the wrapped model, the optimizer, the learning-rate schedule and the precision
handling. Before any process exists, `resolve` completes the run configuration and freezes the
backend's spec (BackendSpec: its config file, read once: FSDPConfig, FSDP2Config, DeepSpeedSpec), which
the backend keeps and the record stores whole (config.json's `plan`). What it holds per rank it reports through a small
separate interface (`accounting()`, core/memory.py); how it is set up through `describe`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn

from core.config import (DEFAULT_GRAD_ACCUM, DEFAULT_GRAD_CLIP, DEFAULT_LR, DEFAULT_LR_WARMUP_STEPS,
                         DEFAULT_MICRO_BATCH, RunConfig)
from backends.compile import apply_compile, uses_cudagraphs
from backends.memory_layout import Layout
from backends.registry import flag_owners
from core.blocks import find_blocks
from core.dist import DistEnv, init_process_group
from core import comm
from core.memory import MemoryAccounting
from core.memory_profile import LoadPeak
from core.owned import TORCH_FORMAT
from gptlite.errors import ConfigError

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


class BackendSpec:
    """A backend's frozen, recorded spec: what `Backend.resolve` decided from its config file and the
    flags (FSDPConfig, FSDP2Config, DeepSpeedSpec; frozen dataclasses). The backend, the run record
    (config.json's `plan`, its name there kept for the records already written) and the estimator all
    read this one object."""


@dataclass(frozen=True)
class Resolved:
    """What `Backend.resolve` decided: the backend, the completed run configuration, and the
    backend's spec (None for backends without options: single, ddp, accelerate)."""

    backend: type["Backend"]
    cfg: RunConfig
    spec: BackendSpec | None = None

    def spec_record(self) -> dict | None:
        """The spec as the record stores it (config.json's `plan`)."""
        return dataclasses.asdict(self.spec) if self.spec is not None else None

    def build(self, env: DistEnv) -> "Backend":
        return self.backend(self.cfg, env, self.spec)


class Backend(ABC):
    name: ClassVar[str]
    # The launcher its users type (orchestration/launch.py): python, torchrun or deepspeed.
    launcher: ClassVar[str] = "torchrun"
    # Whether the backend needs a torch.distributed process group (even for a world of one).
    needs_process_group: ClassVar[bool] = True
    # Whether the backend wraps or shards the model block by block (FSDP's units, FSDP2's shards).
    wraps_blocks: ClassVar[bool] = False
    # How save_checkpoint writes: "torch" (state dicts), "dcp" (torch.distributed.checkpoint) or
    # "deepspeed" (the engine's own); training/export.py reads each back into one state dict.
    checkpoint_format: ClassVar[str] = TORCH_FORMAT
    # The run's flags only this backend reads (core/config.py marks them backend_flag); another
    # backend refuses them.
    owned_flags: ClassVar[tuple[str, ...]] = ()
    # Whether the projection (analysis/project.py --configs) prices it by its name alone, no config file:
    # a distributed backend whose every option has a default it can price.
    projected_by_name: ClassVar[bool] = False
    # Whether the planner (analysis/plan --configs) runs it by its name alone, no config file.
    planned_by_name: ClassVar[bool] = False
    # Loading a checkpoint (--model_name_or_path): the window's peak bytes (core/memory_profile.py LoadPeak).
    load_peak: LoadPeak | None = None
    # Whether it runs as one process, standing in for a world's ranks (a sweep accumulates over them).
    one_process: ClassVar[bool] = False
    # The train.py flag that names its config file (fsdp_config, deepspeed_config), and the shipped files
    # it reads; whether it runs only from such a file (a sweep refuses its bare name).
    config_flag: ClassVar[str | None] = None
    config_files: ClassVar[str | None] = None
    needs_config_file: ClassVar[bool] = False
    # The --ckpt_impl values only this backend runs (DeepSpeed's own checkpointing).
    ckpt_impls: ClassVar[tuple[str, ...]] = ()
    # The flag that places its swap files (ZeRO-Infinity's NVMe), which a sweep or a simulation points
    # at a directory of its own.
    swap_flag: ClassVar[str | None] = None
    # How its bookkeeping grows with a simulated world (simulation/fake_world.py PER_RANK_PER_BLOCK).
    fake_world_family: ClassVar[str] = "replica"

    def __init__(self, cfg: RunConfig, env: DistEnv, spec: BackendSpec | None = None):
        self.cfg = cfg
        self.env = env
        self.spec = spec
        self.model: nn.Module | None = None

    @classmethod
    def resolve(cls, cfg: RunConfig, env: DistEnv) -> Resolved:
        """`cfg` completed with this backend's defaults, and its spec.

        Raises ConfigError for what this backend cannot run (world size, options); called before
        any process group exists, so bad input fails fast with a one-line error. Subclasses with
        a config file read it here, once, and pass the result on as the spec.
        """
        return cls.resolved(cfg, env)

    @classmethod
    def resolved(cls, cfg: RunConfig, env: DistEnv, spec: BackendSpec | None = None) -> Resolved:
        """The checks and defaults every backend shares: options other backends own are refused."""
        for name in cfg.backend_specific():
            if name not in cls.owned_flags:
                owners = flag_owners(name)
                which = f"backends {' and '.join(owners)}" if len(owners) > 1 else f"backend {owners[0]}"
                raise ConfigError(f"{name} applies to {which} (got backend {cls.name!r})")

        def default(value, fallback):
            return fallback if value is None else value

        return Resolved(cls, dataclasses.replace(
            cfg,
            backend=cls.name,
            precision=default(cfg.precision, "fp32"),
            micro_batch=default(cfg.micro_batch, DEFAULT_MICRO_BATCH),
            grad_accum=default(cfg.grad_accum, DEFAULT_GRAD_ACCUM),
            lr=default(cfg.lr, DEFAULT_LR),
            lr_warmup_steps=default(cfg.lr_warmup_steps, DEFAULT_LR_WARMUP_STEPS),
            grad_clip=default(cfg.grad_clip, DEFAULT_GRAD_CLIP),
        ), spec)

    @classmethod
    def init_distributed(cls, env: DistEnv, timeout_s: float) -> None:
        """Create the process group this backend communicates over."""
        init_process_group(env, timeout_s)

    def build_model(self, workload, seed: int) -> nn.Module:
        """The model `setup` receives: by default built whole on every rank (weights from `seed`, or a
        checkpoint's loaded whole: models/pretrained.py). Sharding backends that can load a checkpoint
        without a whole copy per rank override it (FSDP2, ZeRO-3), and measure their loading as here."""
        if workload.pretrained is None:
            return workload.build(seed)
        with LoadPeak(self.env.device, workload.pretrained.checkpoint.file_sizes()) as self.load_peak:
            return workload.build(seed)

    @classmethod
    def loads_checkpoint_sharded(cls, spec) -> bool:
        """Whether build_model loads a checkpoint without a whole copy on any rank (FSDP2, ZeRO-3)."""
        return False

    @classmethod
    def memory_layout(cls, world: int, precision: str, options=None, ranks_per_node: int | None = None) -> Layout:
        """How this backend holds the model's states on each rank of `world` (backends/memory_layout.py),
        for the estimator: `options` its recorded spec's options (FSDP's, DeepSpeed's zero_optimization
        section's config), `ranks_per_node` the hosts' size where a hybrid group defaults to it."""
        raise ConfigError(f"the estimator has no memory layout for backend {cls.name}")

    @classmethod
    def estimator_options(cls, spec: dict | None, described: dict) -> dict:
        """The keyword arguments of estimator/estimate.py:estimate this backend's record gives (its
        recorded spec, or, for records from before plans were recorded, its `backend` section)."""
        return {}

    @classmethod
    def output_dirs(cls, cfg: RunConfig, spec: Any) -> list[tuple[str, str]]:
        """(where, directory) of each directory outside the record this backend writes to (DeepSpeed's
        monitors): the run checks it can write there before it starts."""
        return []

    @classmethod
    def swap_dirs(cls, spec: Any) -> list[str]:
        """The directories this backend swaps model states into (ZeRO-Infinity's NVMe), which one run
        must own while it trains (training/preflight.py NVMeLock)."""
        return []

    @classmethod
    def swaps(cls, config_file: str) -> bool:
        """Whether its config file `config_file` swaps model states to a drive (its swap_flag's directory)."""
        return False

    @classmethod
    def refuses_selective_checkpointing(cls, config_file: str | None) -> bool:
        """Whether a run from `config_file` refuses --ckpt_policy selective (ZeRO-3's wrong gradients)."""
        return False

    @classmethod
    def fake_world_growth(cls, cfg: RunConfig) -> tuple[str, str]:
        """(its fake_world_family under `cfg`, what to call it) for a simulated world's memory."""
        return cls.fake_world_family, cls.name

    @classmethod
    def planner_variants(cls, options: dict | None) -> list[tuple[str, dict]]:
        """The planner's variants of one configuration of this backend (analysis/plan/candidates.py
        variants): (name, what it changes), `options` its config file's keys, or None where it is named
        alone (then what changes are train.py flags)."""
        return []

    @classmethod
    def offload(cls, spec: Any, n_params: int, world: int) -> tuple[bool, bool, float]:
        """(the optimizer state on the host, the parameters on the host, the parameters the host's
        optimizer steps on each rank) under this backend's spec, for the projection and the planner's
        host<->device traffic and CPU optimizer time (analysis/project.py offload_seconds)."""
        return False, False, n_params / world

    @classmethod
    def check_unused_parameters(cls, cfg: RunConfig, what: str) -> None:
        """Refuse (ConfigError, starting with `what`) a model that leaves parameters without a gradient
        (conditional computation), where this backend would train it differently from one process or stop
        on mismatched collectives; one process (and DDP with --find_unused_parameters) trains it as is."""
        raise ConfigError(f"{what}; backend {cls.name} would train it differently from one process (a missing gradient "
                          "becomes a zero one that AdamW still moves) or stop on mismatched collectives: train it with "
                          "--backend ddp --find_unused_parameters, or in one process")

    @abstractmethod
    def setup(self, model: nn.Module) -> None:
        """Wrap `model` (on the CPU, fp32, identical on every rank) and build the optimizer."""

    @classmethod
    def blocks_needed_by(cls, cfg: RunConfig) -> str | None:
        """What in this run needs the model's repeated block (core/blocks.py), or None: a model
        without one trains where nothing does (single, ddp, ZeRO, accelerate, without checkpointing)."""
        if cls.wraps_blocks:
            return f"backend {cls.name}"
        for flag in ("ckpt_interval", "ckpt_plan", "compile", "offload_activations"):
            if getattr(cfg, flag):
                return f"--{flag}"
        if cfg.ckpt_policy == "auto":
            return "--ckpt_policy auto"
        return None

    def prepare_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's blocks (core/blocks.py; [] for a model without any, where nothing needs them),
        kept as self.blocks for the wrappers, checkpointing and offload; with --compile, compiled here,
        before any wrapper sees them (backends/compile.py)."""
        self.blocks = find_blocks(model, self.cfg.block_class, self.blocks_needed_by(self.cfg))
        self.compiled = apply_compile(self.blocks, self.cfg.compile_backend, self.cfg.compile_mode,
                                      self.cfg.compile_memory_budget) \
            if self.cfg.compile else None
        return self.blocks

    @property
    def cudagraphs(self) -> bool:
        """Whether the compiled blocks replay CUDA graphs: the loop marks each training step's first
        forward, and each evaluation forward, a new step then (backends/compile.py, mark_step)."""
        return bool(self.cfg.compile) and uses_cudagraphs(self.cfg.compile_backend, self.cfg.compile_mode)

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
    def accounting(self) -> MemoryAccounting:
        """What this rank holds, by role, for the memory measurements (after setup)."""

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

    def comm_theory(self, n_params: int, trainable: int | None = None, buffers: dict | None = None) -> dict:
        """The collectives a step should need by the textbook accounting (ZeRO paper, FSDP paper),
        from the parameter count: core.comm.theory. `trainable`: the parameters that get a gradient
        (all of them where None): gradients are reduced, and ZeRO-1/2's updated shards gathered, for
        those alone, where FSDP and ZeRO-3 gather every parameter, frozen ones too (a model with
        frozen layers: measured so under gloo, cpu-2core-zoo-median-point/frozen_tied of docs/results/zoo_accuracy_2026-12-05.md).
        `buffers`: the model's buffers' bytes by dtype (Workload.buffer_bytes), which DDP broadcasts
        every step. Nothing to communicate by default."""
        return comm.theory("none: one replica, nothing to synchronise", {}, self.env.world_size)

    def comm_schedule(self, param_sizes: list[int], buffers: dict | None = None) -> dict[str, tuple[float | None, float]]:
        """How comm_theory's collectives run, by kind, for a model of `param_sizes` (the elements
        of each trainable parameter tensor, in order; `buffers` as comm_theory's): (the bytes each
        call carries, from the configuration's bucket sizes, or None where the configuration does
        not say; the share of
        the kind's bytes that waits on the critical path, nothing prefetching it). The planner's
        step-time model prices the calls' latency and the waiting share from it. Empty by default:
        the projection's bucket size, and everything may overlap compute."""
        return {}

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
