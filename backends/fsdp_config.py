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

from backends.base import BackendSpec
from core.configfile import from_dict, read_yaml
from gptlite.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
# FSDP1's hybrid strategies: FULL_SHARD (HYBRID_SHARD) or SHARD_GRAD_OP (_HYBRID_SHARD_ZERO2) within a
# shard group, the shards' gradients all-reduced across the groups.
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
NODE = "node"  # a group size given as the ranks of one node
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
class FSDPConfig(BackendSpec):
    """FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel), auto-wrapped on the model's blocks (core/blocks.py)."""

    backend: str = "fsdp"
    sharding_strategy: str = "FULL_SHARD"
    # HYBRID_SHARD, _HYBRID_SHARD_ZERO2: ranks per shard group (parameters sharded within it,
    # replicated across groups). Default: the ranks of one node.
    hybrid_shard_size: int | None = None
    # A shard group must lie inside one node (the ranks of a node a multiple of hybrid_shard_size):
    # a group spanning nodes puts every all-gather on the slow link, which is what hybrid avoids.
    shard_within_node: bool = True
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
            if self.sharding_strategy not in HYBRID_STRATEGIES:
                raise ConfigError("hybrid_shard_size applies only to sharding_strategy HYBRID_SHARD or "
                                  "_HYBRID_SHARD_ZERO2")
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
class MeshConfig:
    """FSDP2's 2-D device mesh (HSDP, torchtitan's dp_replicate x dp_shard): parameters sharded within
    groups of `shard` ranks, replicated across `replicate` groups, the shards' gradients all-reduced
    between the replicas."""

    replicate: int | None = None  # replica groups; null: world / shard
    shard: int | str = NODE  # ranks per shard group: an integer, or node (the ranks of one node)
    # A shard group must lie inside one node: the all-gathers stay on the fast link.
    within_node: bool = True

    def __post_init__(self):
        if isinstance(self.shard, str) and self.shard != NODE:
            raise ConfigError(f"shard must be an integer >= 1 or {NODE} (got {self.shard!r})")
        if isinstance(self.shard, int) and self.shard < 1:
            raise ConfigError(f"shard must be an integer >= 1 or {NODE} (got {self.shard!r})")
        if self.replicate is not None and self.replicate < 1:
            raise ConfigError(f"replicate must be an integer >= 1 or null (got {self.replicate!r})")


@dataclass(frozen=True)
class FSDP2Config(BackendSpec):
    """FSDP2 (torch.distributed.fsdp.fully_shard) on each block (core/blocks.py), then the root."""

    backend: str = "fsdp2"
    # true: parameters resharded after forward (FULL_SHARD's analogue); false: kept unsharded until
    # backward (SHARD_GRAD_OP's analogue); an integer R or node: resharded to groups of R ranks (the
    # ranks of one node), so backward's all-gather stays in that smaller group.
    reshard_after_forward: bool | int | str = True
    # null: a 1-D mesh of every rank; else a replicate x shard mesh (HSDP).
    mesh: MeshConfig | None = None
    mixed_precision: MixedPrecisionPolicyConfig | None = None
    cpu_offload: bool = False  # CPUOffloadPolicy: sharded parameters, gradients, optimizer step on host

    mixed_precision_class: ClassVar[type] = MixedPrecisionPolicyConfig

    def __post_init__(self):
        _check_choice("backend", self.backend, ("fsdp2",))
        r = self.reshard_after_forward
        if isinstance(r, str) and r != NODE:
            raise ConfigError(f"reshard_after_forward must be true, false, an integer >= 1 or {NODE} (got {r!r})")
        if isinstance(r, int) and not isinstance(r, bool) and r < 1:
            raise ConfigError(f"reshard_after_forward must be true, false, an integer >= 1 or {NODE} (got {r!r})")


def _size(value, per_node: int) -> int:
    return per_node if value == NODE else value


def hybrid_groups(options, world: int, per_node: int) -> tuple[int, int]:
    """(replicas, ranks per shard group) of an FSDP1 or FSDP2 configuration on `world` ranks,
    `per_node` to a node; a shape that does not fit, refused in one line naming its key.
    Not hybrid: (1, world)."""
    if isinstance(options, FSDPConfig):
        if options.sharding_strategy not in HYBRID_STRATEGIES:
            return 1, world
        key, shard, within = "hybrid_shard_size", options.hybrid_shard_size or per_node, options.shard_within_node
        replicate = None
        within_key = "shard_within_node"
    else:
        if options.mesh is None:
            return 1, world
        m = options.mesh
        key, shard, within, replicate, within_key = "mesh.shard", _size(m.shard, per_node), m.within_node, \
            m.replicate, "mesh.within_node"
    if shard > world or world % shard:
        raise ConfigError(f"{key} {shard} must divide the world size {world} (ranks per shard group; "
                          f"{world} = replicas x shard)")
    if replicate is not None and replicate * shard != world:
        raise ConfigError(f"mesh.replicate {replicate} x mesh.shard {shard} must equal the world size {world} "
                          "(or leave mesh.replicate null)")
    if within and (shard > per_node or per_node % shard):
        raise ConfigError(f"{key} {shard} spans nodes of {per_node} ranks, and {within_key} asks for a shard group "
                          f"inside one node: a size dividing {per_node}, or {within_key}: false")
    return world // shard, shard


def post_forward_group(options: "FSDP2Config", shard: int, per_node: int) -> int:
    """The ranks a parameter is resharded to after forward (FSDP2): the shard group (true), 1 (false:
    kept whole), or an integer / node that divides the shard group, refused in one line otherwise."""
    r = options.reshard_after_forward
    if isinstance(r, bool):
        return shard if r else 1
    size = _size(r, per_node)
    if size > shard or shard % size:
        raise ConfigError(f"reshard_after_forward {r} ({size} ranks) must divide the shard group of {shard} ranks "
                          "(true: the whole group, false: none)")
    return size


CONFIG_CLASSES = {"fsdp": FSDPConfig, "fsdp2": FSDP2Config}
DEFAULT_BACKEND = "fsdp"  # a file without `backend:`


def load(path: str) -> FSDPConfig | FSDP2Config:
    """The config in `path`; its `backend` key picks the dataclass (default fsdp)."""
    raw = read_yaml(path, flag="--fsdp_config")
    backend = raw.get("backend", DEFAULT_BACKEND)
    if not isinstance(backend, str) or backend not in CONFIG_CLASSES:
        raise ConfigError(f"--fsdp_config {path}: backend must be one of fsdp, fsdp2 (got {backend!r})")
    if backend == "fsdp" and "mesh" in raw:
        # FSDP1's 2-D mesh is hybrid_shard_size's: a readable refusal, not "unknown key".
        raise ConfigError(f"--fsdp_config {path}: mesh: backend fsdp (FSDP1) takes no device mesh; use "
                          "sharding_strategy HYBRID_SHARD with hybrid_shard_size, or backend fsdp2")
    return from_dict(CONFIG_CLASSES[backend], raw, where=f"--fsdp_config {path}")


def default(backend: str) -> FSDPConfig | FSDP2Config:
    """No file: FULL_SHARD (or reshard after forward) in fp32."""
    return CONFIG_CLASSES[backend]()


def precision_of(options: FSDPConfig | FSDP2Config) -> str:
    return options.mixed_precision.precision if options.mixed_precision else "fp32"


def options_for(cfg, backend: str, loaded: FSDPConfig | FSDP2Config | None = None) -> FSDPConfig | FSDP2Config:
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


class FSDPFileAnswers:
    """What FSDP1 and FSDP2 answer alike from their fsdp_configs/ file (Backend.offload,
    Backend.estimator_options): one place for both."""

    @classmethod
    def offload(cls, spec, n_params, world) -> tuple[bool, bool, float]:
        return spec.cpu_offload, spec.cpu_offload, n_params / world  # CPU offload: parameters and optimizer

    @classmethod
    def estimator_options(cls, spec, described) -> dict:
        return {"fsdp_options": from_record(spec if spec is not None else described["options"])}
