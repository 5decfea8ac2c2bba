"""`fsdp2`: torch's composable `fully_shard` on each block (core/blocks.py: GPT-lite's Block), then on the root.

Parameters become DTensors sharded on dim 0 over a 1-D device mesh of all ranks, or (the file's
`mesh`: HSDP) over the `shard` dimension of a replicate x shard mesh, replicated across the other,
the shards' gradients all-reduced between replicas. `reshard_after_forward` as a group size keeps
each parameter sharded over that smaller group between forward and backward. FSDP2 has no
`sync_module_states`: every rank builds identical weights from the seed (gptlite.model.build_model),
which is what makes the shards consistent. On CPU, CPUOffloadPolicy runs with pin_memory off
(pinning needs an accelerator).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from backends import fsdp_config
from backends.dcp_checkpoint import DCPCheckpointMixin
from backends.memory_layout import Layout, compute_bytes
from backends.torch_backend import TorchAccounting, TorchBackend
from core import comm
from core.memory_profile import LoadPeak


class FSDP2Accounting(TorchAccounting):
    def gathered_root(self) -> nn.Module:
        return self.backend.model

    def gathered_bytes(self) -> int:
        """After the root's forward: all-gathered parameters still allocated (freed in backward)."""
        return sum(t.untyped_storage().nbytes() for p in self.backend.fsdp_params() for t in p.all_gather_outputs)

    def extra_parameter_storage(self) -> list:
        # While gathered, the module's parameters are the unsharded ones; the shards stay.
        return [p._sharded_param_data for p in self.backend.fsdp_params()]


class FSDP2Backend(fsdp_config.FSDPFileAnswers, DCPCheckpointMixin, TorchBackend):
    name = "fsdp2"
    owned_flags = ("fsdp_config",)
    projected_by_name = planned_by_name = True
    wraps_blocks = True  # fully_shard on each block
    config_flag, config_files = "fsdp_config", "fsdp_configs/*.yaml"
    fake_world_family = "sharded_blocks"
    uses_autocast = False  # the MixedPrecisionPolicy casts; no autocast on top

    @classmethod
    def resolve(cls, cfg, env, options: fsdp_config.FSDP2Config | None = None):
        options = fsdp_config.options_for(cfg, cls.name, options)
        _, shard = fsdp_config.hybrid_groups(options, env.world_size, env.local_world_size)
        fsdp_config.post_forward_group(options, shard, env.local_world_size)
        cfg = dataclasses.replace(cfg, precision=fsdp_config.precision_of(options))
        super().resolve(cfg, env)  # the torch backends' checks
        return cls.resolved(cfg, env, spec=options)

    @classmethod
    def memory_layout(cls, world, precision, options=None, ranks_per_node=None) -> Layout:
        o = options or fsdp_config.FSDP2Config()
        per_node = ranks_per_node or world
        _, shards = fsdp_config.hybrid_groups(o, world, per_node)  # the mesh's shard group (the world without one)
        post = fsdp_config.post_forward_group(o, shards, per_node)
        # Resharded to the whole shard group (true; also on one rank) / kept whole (false) / to a smaller group.
        kind = "full_shard" if post == shards else "shard_grad_op" if post == 1 else "full_shard"
        return Layout(kind, shards, offload=o.cpu_offload, compute_bytes=compute_bytes(precision) if o.mixed_precision
                      else 4, post_forward=post if 1 < post < shards else 0, offload_params=o.cpu_offload,
                      sharded_units=True, holds_reduce_scatter_input=True)

    pretrained = None  # a checkpoint to load shard by shard after sharding (build_model)

    @classmethod
    def loads_checkpoint_sharded(cls, spec) -> bool:
        return True

    def build_model(self, workload, seed: int) -> nn.Module:
        """A checkpoint: the model with its parameters on the meta device (no memory), loaded after
        fully_shard, each rank reading its own shards (models/pretrained.py)."""
        if workload.pretrained is None:
            return super().build_model(workload, seed)
        self.pretrained = workload.pretrained
        model, self.pretrained_buffers = workload.pretrained.empty()
        return model

    def setup(self, model: nn.Module) -> None:
        self.options = self.spec
        super().setup(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        o = self.options
        mp = o.mixed_precision
        dtype = fsdp_config.DTYPES
        replicas, shard = self.groups()
        if o.mesh is None:
            mesh = init_device_mesh(self.env.device.type, (self.env.world_size,))
        else:  # HSDP: shard groups of consecutive ranks (a node's), replica groups across them
            mesh = init_device_mesh(self.env.device.type, (replicas, shard), mesh_dim_names=("replicate", "shard"))
        post = fsdp_config.post_forward_group(o, shard, self.env.local_world_size)
        kwargs = dict(
            mesh=mesh,
            # torch's own reading of an integer: 1 keeps parameters whole (false), the shard group's size reshards
            # fully (true); said as the booleans, which it takes without a warning.
            reshard_after_forward=post if 1 < post < shard else post == shard,
            mp_policy=MixedPrecisionPolicy(param_dtype=dtype[mp.param_dtype], reduce_dtype=dtype[mp.reduce_dtype])
            if mp else MixedPrecisionPolicy(),
            offload_policy=CPUOffloadPolicy(pin_memory=self.env.device.type == "cuda") if o.cpu_offload
            else OffloadPolicy(),
        )
        if self.pretrained is None:
            return self._shard(model, kwargs)
        with LoadPeak(self.env.device, self.pretrained.checkpoint.file_sizes(), shapes=False) as self.load_peak:
            self._shard(model, kwargs)
            # The shards get storage (on the host where offloaded), the buffers their values back,
            # then each rank reads its shards of the checkpoint.
            model.to_empty(device="cpu" if o.cpu_offload else self.env.device)
            for name, value in self.pretrained_buffers.items():
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._buffers[leaf] = value.to(self.env.device)
            self.pretrained.checkpoint.load_fsdp2(model.net)
        return model

    def _shard(self, model: nn.Module, kwargs: dict) -> nn.Module:
        for block in self.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def groups(self) -> tuple[int, int]:
        """(replicas, ranks per shard group): (1, world) without a mesh."""
        return fsdp_config.hybrid_groups(self.spec, self.env.world_size, self.env.local_world_size)

    def micro_step(self, sync: bool):
        # Skipping the reduce-scatter on non-final micro-steps: FSDP2's no_sync.
        self.model.set_requires_gradient_sync(sync)
        return super().micro_step(sync)

    def fsdp_params(self):
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                group = m._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    yield from group.fsdp_params

    def accounting(self) -> FSDP2Accounting:
        return FSDP2Accounting(self)

    def comm_theory(self, n_params: int, trainable: int | None = None, buffers: dict | None = None) -> dict:
        """Resharding after forward: all-gathered for forward and again for backward, gradients
        reduce-scattered (3 Psi (N-1)/N); without: gathered once (2 Psi (N-1)/N); resharded to groups
        of R ranks: backward's gather in those (Psi (R-1)/R). Every parameter gathered, the trainable
        ones' gradients alone reduced. With a mesh (HSDP) N is the shard group, and each rank's shard
        of the gradients is all-reduced across the replicas (2 Psi/S (R-1)/R): the only bytes between
        shard groups."""
        o, n, accum = self.spec, self.env.world_size, self.cfg.grad_accum  # the plan: no setup needed
        mp = o.mixed_precision
        c, r = (fsdp_config.BYTES[mp.param_dtype], fsdp_config.BYTES[mp.reduce_dtype]) if mp else (4, 4)
        if n == 1:
            return super(TorchBackend, self).comm_theory(n_params, trainable)
        grads = n_params if trainable is None else trainable
        replicas, shard = self.groups()
        post = fsdp_config.post_forward_group(o, shard, self.env.local_world_size)
        terms = {"all_gather": ((2 if post == shard else 1) * accum * n_params, c, shard)}
        if 1 < post < shard:
            terms["all_gather:post_forward"] = (accum * n_params, c, post)
        terms["reduce_scatter"] = (grads, r, shard)
        if replicas > 1:
            terms["all_reduce"] = (grads / shard, r, replicas, shard)
        gathered = {shard: "gather twice", 1: "gather once"}.get(post, f"gather in {shard}, again in {post}")
        formula = f"{gathered}, reduce-scatter: {2 if post == 1 else 3} Psi (N-1)/N"
        if replicas > 1:
            formula += f" within shard groups of {shard}, all-reduce of the shards across {replicas} replicas"
        return comm.theory(formula, terms, n, self.env.local_world_size)

    def describe(self) -> dict:
        mp = self.options.mixed_precision
        return {
            **super().describe(),
            "wrapper": "fully_shard (FSDP2)",
            "compute_dtype": mp.param_dtype if mp else "fp32",
            "reduce_dtype": mp.reduce_dtype if mp else "fp32",
            "cpu_offload_applied": self.options.cpu_offload,
            "mesh": dict(zip(("replicate", "shard"), self.groups())),
            "reshard_after_forward_group": fsdp_config.post_forward_group(
                self.options, self.groups()[1], self.env.local_world_size),
        }
