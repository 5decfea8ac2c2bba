"""The YAML files in fsdp_configs/: one dataclass per backend, every key and value checked.

A file names its backend (`backend: fsdp` or `backend: fsdp2`), so `--fsdp_config` alone selects
it. Keys are FSDP's own option names; see fsdp_configs/README.md for each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from gptlite.errors import ConfigError
from core.configfile import from_dict, read_yaml

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST")


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        names = ", ".join("null" if a is None else str(a) for a in allowed)  # YAML's word for None
        raise ConfigError(f"{name} must be one of {names} (got {value!r})")


@dataclass(frozen=True)
class MixedPrecisionConfig:
    """Dtypes of FSDP's mixed precision. The sharded master parameters stay fp32 either way."""

    param_dtype: str = "fp32"  # dtype of the unsharded parameters used in forward and backward
    reduce_dtype: str = "fp32"  # dtype of the gradient reduce-scatter / all-reduce
    buffer_dtype: str = "fp32"  # FSDP1 only: dtype of module buffers (GPT-lite has none)

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            _check_choice(name, getattr(self, name), tuple(DTYPES))

    @property
    def precision(self) -> str:
        """The run's precision name: that of the compute (parameter) dtype."""
        return self.param_dtype

    @classmethod
    def for_precision(cls, precision: str) -> "MixedPrecisionConfig | None":
        """What `--precision` means when it overrides a file: compute in it, reduce in fp32."""
        return None if precision == "fp32" else cls(precision, "fp32", precision)


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel), auto-wrapped on the model's blocks (core/blocks.py)."""

    backend: str = "fsdp"
    sharding_strategy: str = "FULL_SHARD"
    # HYBRID_SHARD: ranks per shard group (parameters sharded within it, replicated across groups).
    # Default: the ranks of one node.
    hybrid_shard_size: int | None = None
    mixed_precision: MixedPrecisionConfig | None = None
    cpu_offload: bool = False  # CPUOffload(offload_params=True): parameters and gradients in host memory
    backward_prefetch: str | None = "BACKWARD_PRE"  # or BACKWARD_POST, or null for none
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    sync_module_states: bool = True  # broadcast rank 0's weights before sharding

    mixed_precision_class: ClassVar[type] = MixedPrecisionConfig

    def __post_init__(self):
        _check_choice("backend", self.backend, ("fsdp",))
        _check_choice("sharding_strategy", self.sharding_strategy, SHARDING_STRATEGIES)
        if self.backward_prefetch is not None:
            _check_choice("backward_prefetch", self.backward_prefetch, (*BACKWARD_PREFETCH, None))
        if self.hybrid_shard_size is not None:
            if self.sharding_strategy != "HYBRID_SHARD":
                raise ConfigError("hybrid_shard_size applies only to sharding_strategy HYBRID_SHARD")
            if self.hybrid_shard_size < 2:
                # FSDP1 turns a shard group of one into NO_SHARD over that group alone, so the
                # replicas never average their gradients: silent divergence, not an error.
                raise ConfigError(f"hybrid_shard_size must be >= 2 (got {self.hybrid_shard_size}): FSDP1 "
                                  "never syncs gradients between replicas with shard groups of one rank")


@dataclass(frozen=True)
class MixedPrecisionPolicyConfig:
    """FSDP2's MixedPrecisionPolicy."""

    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            _check_choice(name, getattr(self, name), tuple(DTYPES))

    @property
    def precision(self) -> str:
        return self.param_dtype

    @classmethod
    def for_precision(cls, precision: str) -> "MixedPrecisionPolicyConfig | None":
        return None if precision == "fp32" else cls(precision, "fp32")


@dataclass(frozen=True)
class FSDP2Config:
    """FSDP2 (torch.distributed.fsdp.fully_shard) on each block (core/blocks.py), then the root."""

    backend: str = "fsdp2"
    # true: parameters resharded after forward (FULL_SHARD's analogue); false: kept unsharded until
    # backward (SHARD_GRAD_OP's analogue).
    reshard_after_forward: bool = True
    mixed_precision: MixedPrecisionPolicyConfig | None = None
    cpu_offload: bool = False  # CPUOffloadPolicy: sharded parameters, gradients, optimizer step on host

    mixed_precision_class: ClassVar[type] = MixedPrecisionPolicyConfig

    def __post_init__(self):
        _check_choice("backend", self.backend, ("fsdp2",))


CONFIG_CLASSES = {"fsdp": FSDPConfig, "fsdp2": FSDP2Config}


def load(path: str) -> FSDPConfig | FSDP2Config:
    """The config in `path`; its `backend` key picks the dataclass (default fsdp)."""
    raw = read_yaml(path, flag="--fsdp_config")
    backend = raw.get("backend", "fsdp")
    if not isinstance(backend, str) or backend not in CONFIG_CLASSES:
        raise ConfigError(f"--fsdp_config {path}: backend must be one of fsdp, fsdp2 (got {backend!r})")
    return from_dict(CONFIG_CLASSES[backend], raw, where=f"--fsdp_config {path}")


def default(backend: str) -> FSDPConfig | FSDP2Config:
    """No file: FULL_SHARD (or reshard after forward) in fp32."""
    return CONFIG_CLASSES[backend]()


def precision_of(options: FSDPConfig | FSDP2Config) -> str:
    return options.mixed_precision.precision if options.mixed_precision else "fp32"


def resolve_options(cfg, backend: str, loaded: FSDPConfig | FSDP2Config | None = None) -> FSDPConfig | FSDP2Config:
    """The options a run of `backend` uses: its --fsdp_config file (`loaded` when the caller has
    read it already; else read now) or the default, with --precision, when given, replacing the
    file's mixed precision."""
    options = loaded or (load(cfg.fsdp_config) if cfg.fsdp_config else default(backend))
    if options.backend != backend:
        raise ConfigError(f"--fsdp_config {cfg.fsdp_config} is for backend {options.backend}, not {backend}")
    if cfg.precision is not None and cfg.precision != precision_of(options):
        options = dataclasses.replace(
            options, mixed_precision=options.mixed_precision_class.for_precision(cfg.precision))
    return options


def shipped_configs() -> list[Path]:
    return sorted((Path(__file__).resolve().parent.parent / "fsdp_configs").glob("*.yaml"))


def from_record(plan: dict) -> FSDPConfig | FSDP2Config:
    """The options as a run record's `plan` holds them (what the estimator reads back)."""
    cls = FSDP2Config if plan.get("backend") == "fsdp2" else FSDPConfig
    return from_dict(cls, plan, where="the run record's plan")
