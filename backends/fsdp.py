"""`fsdp`: torch FullyShardedDataParallel (FSDP1), one FSDP unit per block (core/blocks.py: GPT-lite's
Block) plus the root.

Options come from an fsdp_configs/*.yaml file (backends/fsdp_config.py). Three adaptations keep
every option usable on a CPU-only machine, each recorded in the run's config.json:
- FSDP1 refuses the CPU without an explicit `device_id`, so the device is always passed;
- `sync_module_states` requires accelerator tensors, so on CPU the backend broadcasts rank 0's
  weights itself before sharding (the same effect);
- `CPUOffload(offload_params=True)` pins host memory, which needs an accelerator; on CPU the
  parameters already live in host memory, so the option is recorded as not applied.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, FullyShardedDataParallel, MixedPrecision,
                                    ShardingStrategy)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from backends import fsdp_config
from backends.dcp_checkpoint import DCPCheckpointMixin
from backends.memory_layout import Layout, compute_bytes
from backends.torch_backend import TorchAccounting, TorchBackend
from core import comm
from gptlite.errors import ConfigError

# FSDP1 warns that NO_SHARD is deprecated in favour of DDP; the suite runs it on purpose.
warnings.filterwarnings("ignore", message=".*NO_SHARD.*deprecated", category=FutureWarning)


class FSDPAccounting(TorchAccounting):
    def gathered_root(self) -> nn.Module:
        return self.backend.model

    def gathered_bytes(self) -> int:
        """After the root's forward: unsharded parameters still allocated (freed in backward)."""
        return sum(
            h.flat_param._full_param_padded.untyped_storage().nbytes()
            for h in self.backend.handles() if h.uses_sharded_strategy and hasattr(h.flat_param, "_full_param_padded"))

    def extra_parameter_storage(self) -> list[torch.Tensor]:
        # While a unit is gathered, its parameters point into the full buffer; the shard stays.
        return [getattr(h.flat_param, "_local_shard", h.flat_param) for h in self.backend.handles()]


class FSDPBackend(fsdp_config.FSDPFileAnswers, DCPCheckpointMixin, TorchBackend):
    name = "fsdp"
    owned_flags = ("fsdp_config",)
    projected_by_name = planned_by_name = True
    wraps_blocks = True  # one FSDP unit per block
    uses_autocast = False  # FSDP casts parameters itself; autocast on top would change what mixed precision means
    config_flag, config_files = "fsdp_config", "fsdp_configs/*.yaml"
    fake_world_family = "sharded_blocks"

    @classmethod
    def planner_variants(cls, options):
        """A file's: resharding after forward without backward prefetch (backward's gathers wait)."""
        if options is not None and options.get("sharding_strategy", "FULL_SHARD") in (
                "FULL_SHARD", "HYBRID_SHARD") and options.get("backward_prefetch", "BACKWARD_PRE") is not None:
            return [("no_backward_prefetch", {"backward_prefetch": None})]
        return []

    @classmethod
    def resolve(cls, cfg, env, options: fsdp_config.FSDPConfig | None = None):
        options = fsdp_config.options_for(cfg, cls.name, options)
        if options.sharding_strategy in fsdp_config.HYBRID_STRATEGIES:
            size = options.hybrid_shard_size or env.local_world_size
            if size < 2 or env.world_size % size:
                raise ConfigError(
                    f"hybrid_shard_size {size} must be >= 2 and divide the world size {env.world_size} "
                    f"({options.sharding_strategy} shards within groups of that many ranks and replicates across them)")
            fsdp_config.hybrid_groups(options, env.world_size, env.local_world_size)  # inside a node, where asked
        cfg = dataclasses.replace(cfg, precision=fsdp_config.precision_of(options))
        super().resolve(cfg, env)  # the torch backends' checks
        return cls.resolved(cfg, env, spec=options)

    @classmethod
    def memory_layout(cls, world, precision, options=None, ranks_per_node=None) -> Layout:
        o = options or fsdp_config.FSDPConfig()
        mp = compute_bytes(precision) if o.mixed_precision else 4
        if o.sharding_strategy == "NO_SHARD" or world == 1:
            # FSDP1 runs every strategy as NO_SHARD on one rank (it switches and warns).
            return Layout("replicated", offload=o.cpu_offload, compute_bytes=mp, offload_params=o.cpu_offload)
        shards = world
        if o.sharding_strategy in fsdp_config.HYBRID_STRATEGIES:
            shards = o.hybrid_shard_size or ranks_per_node or world
            if shards < 2 or world % shards:
                raise ConfigError(f"hybrid_shard_size {shards} must be >= 2 and divide the world size {world}")
        kind = "shard_grad_op" if o.sharding_strategy in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2") else "full_shard"
        # Flat parameters per unit: a unit's gradients flattened whole on their way into the reduce-scatter.
        return Layout(kind, shards, fsdp1_root_gathered=True, offload=o.cpu_offload, compute_bytes=mp,
                      offload_params=o.cpu_offload, sharded_units=True, flat_unit_grads=True)

    def setup(self, model: nn.Module) -> None:
        self.options = self.spec
        self.notes: list[str] = []
        super().setup(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        o = self.options
        on_cpu = self.env.device.type == "cpu"
        if o.sync_module_states and on_cpu:
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(tensor, src=0)
            self.notes.append("sync_module_states: rank 0's weights broadcast before sharding "
                              "(FSDP1's own option needs accelerator tensors)")
        offload = o.cpu_offload and not on_cpu
        if o.cpu_offload and on_cpu:
            self.notes.append("cpu_offload: not applied; on a CPU-only run the parameters already live "
                              "in host memory (FSDP1's CPUOffload pins memory, which needs an accelerator)")
        kwargs = dict(
            device_id=self.env.device,
            sharding_strategy=ShardingStrategy[o.sharding_strategy],
            auto_wrap_policy=ModuleWrapPolicy({type(self.blocks[0])}),
            mixed_precision=_fsdp_mixed_precision(o.mixed_precision),
            cpu_offload=CPUOffload(offload_params=offload),
            backward_prefetch=BackwardPrefetch[o.backward_prefetch] if o.backward_prefetch else None,
            forward_prefetch=o.forward_prefetch,
            limit_all_gathers=o.limit_all_gathers,
            use_orig_params=o.use_orig_params,
            sync_module_states=o.sync_module_states and not on_cpu,
        )
        if o.sharding_strategy in fsdp_config.HYBRID_STRATEGIES:
            # Shard groups of consecutive ranks (one node's, as torchrun numbers them), replica groups across.
            size = o.hybrid_shard_size or self.env.local_world_size
            kwargs["device_mesh"] = init_device_mesh(
                self.env.device.type, (self.env.world_size // size, size), mesh_dim_names=("replicate", "shard"))
        self.offload_applied = offload
        return FullyShardedDataParallel(model, **kwargs)

    def build_scaler(self, enabled: bool):
        # The device must be named: ShardedGradScaler defaults to "cuda" and silently disables
        # itself without CUDA.
        return ShardedGradScaler(device=self.env.device.type, enabled=enabled)

    def clip_grad_norm(self, max_norm: float) -> None:
        self.model.clip_grad_norm_(max_norm)  # FSDP1's own: the norm over every rank's shards

    def micro_step(self, sync: bool):
        return super().micro_step(sync) if sync else self.model.no_sync()

    def handles(self):
        return [m._handle for m in FullyShardedDataParallel.fsdp_modules(self.model) if m._handle is not None]

    def accounting(self) -> FSDPAccounting:
        return FSDPAccounting(self)

    def comm_theory(self, n_params: int, trainable: int | None = None, buffers: dict | None = None) -> dict:
        """FULL_SHARD: each unit all-gathered for forward and again for backward, gradients
        reduce-scattered: 3 Psi (N-1)/N; SHARD_GRAD_OP gathers once: 2 Psi (N-1)/N; NO_SHARD
        all-reduces; HYBRID_SHARD (_HYBRID_SHARD_ZERO2) does FULL_SHARD (SHARD_GRAD_OP) within a
        shard group and all-reduces each shard across the replicas: the only bytes between groups. Gathers happen every micro-step, reductions once a step. Every parameter
        is gathered, the trainable ones' gradients alone reduced (a unit of frozen parameters reduces
        nothing; one that mixes them with trainable ones, under use_orig_params, reduces its whole
        flat gradient: counted as its trainable part, the lower bound)."""
        o, n, accum = self.spec, self.env.world_size, self.cfg.grad_accum  # the plan: no setup needed
        mp = o.mixed_precision
        c, r = (fsdp_config.BYTES[mp.param_dtype], fsdp_config.BYTES[mp.reduce_dtype]) if mp else (4, 4)
        if n == 1:
            return super(TorchBackend, self).comm_theory(n_params, trainable)
        grads = n_params if trainable is None else trainable
        if o.sharding_strategy == "NO_SHARD":
            return comm.theory("all-reduce of the gradients: 2 Psi (N-1)/N", {"all_reduce": (grads, r, n)}, n)
        hybrid = o.sharding_strategy in fsdp_config.HYBRID_STRATEGIES
        shard = (o.hybrid_shard_size or self.env.local_world_size) if hybrid else n
        gathers = 1 if o.sharding_strategy in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2") else 2
        # Shard groups of consecutive ranks; a replica group takes one rank of each, `shard` apart.
        terms = {"all_gather": (gathers * accum * n_params, c, shard), "reduce_scatter": (grads, r, shard),
                 "all_reduce": (grads / shard, r, n // shard, shard)}
        formula = {1: "gather once, reduce-scatter: 2 Psi (N-1)/N", 2: "gather twice, reduce-scatter: 3 Psi (N-1)/N"}
        return comm.theory(formula[gathers] + (" within shard groups, all-reduce of the shards across replicas"
                                               if shard < n else ""), terms, n, self.env.local_world_size)

    def comm_schedule(self, param_sizes: list[int], buffers: dict | None = None) -> dict[str, tuple[float | None, float]]:
        """Resharded after forward (FULL_SHARD, HYBRID_SHARD), a unit is gathered again in backward:
        half the gathered bytes, less the root's (never resharded). With backward_prefetch null
        nothing issues the next unit's gather ahead and those wait: counted as the half, an upper
        bound. Calls follow the units, not a bucket size: the projection's bucket size prices them."""
        o = self.spec
        waits = 0.5 if o.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD") and o.backward_prefetch is None else 0.0
        return {"all_gather": (None, waits)}

    def describe(self) -> dict:
        o = self.options
        mp = o.mixed_precision
        return {
            **super().describe(),
            "wrapper": "FullyShardedDataParallel",
            "compute_dtype": mp.param_dtype if mp else "fp32",
            "reduce_dtype": mp.reduce_dtype if mp else "fp32",
            "cpu_offload_applied": self.offload_applied,
            "notes": self.notes,
        }


def _fsdp_mixed_precision(mp: fsdp_config.MixedPrecisionConfig | None) -> MixedPrecision | None:
    if mp is None:
        return None
    dtype = fsdp_config.DTYPES
    return MixedPrecision(param_dtype=dtype[mp.param_dtype], reduce_dtype=dtype[mp.reduce_dtype],
                          buffer_dtype=dtype[mp.buffer_dtype])
