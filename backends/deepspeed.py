"""`deepspeed`: DeepSpeed's engine with ZeRO stages 0-3, ZeRO-Offload, ZeRO-Infinity and ZeRO++.

Launched as DeepSpeed users launch (`deepspeed --num_gpus N train.py --deepspeed_config ...`),
or through torchrun, or as one process. Everything comes from the JSON file (ds_configs/), with
batch sizes, precision, learning rate and warm-up from the flags when given
(backends/deepspeed_config.py). DeepSpeed builds its optimizer from the file (FusedAdam, or
DeepSpeedCPUAdam when the optimizer is offloaded): on this suite's parity runs they match torch's
AdamW to about 3e-7 relative over 10 steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn

from backends import deepspeed_config, deepspeed_spec
from backends.deepspeed_config import monitor_paths
from backends.activation_checkpointing import apply_ac
from backends.activation_offload import make_offloader
from backends.base import Backend, Resolved
from backends.memory_layout import Layout, compute_bytes
from backends.deepspeed_support import (deepspeed_wrapper, import_deepspeed, model_state_estimate,
                                        replay_adam_step_count, unlink_shm_allreduce_buffer)
from core.config import DEEPSPEED_CKPT_IMPLS
from core.dist import ensure_rendezvous_env
from core.owned import DEEPSPEED_FORMAT
from core import comm
from core.memory import MemoryAccounting
from core.memory_profile import LoadPeak
from gptlite.errors import ConfigError


def _element_bytes(precision: str) -> int:
    """Bytes of an element DeepSpeed communicates: its 16-bit precisions' 2, fp32's 4."""
    return 2 if precision in ("bf16", "fp16") else 4


class DeepSpeedAccounting(MemoryAccounting):
    """The engine's fp32 master partitions and Adam state, its gradient buffers, and the module's
    (ZeRO-3: partitioned) parameters."""

    def __init__(self, engine):
        self.engine = engine

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        engine, opt = self.engine, self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)  # the optimizer that steps, under the ZeRO wrapper
        module_params = list(engine.module.parameters())
        masters = [*getattr(opt, "single_partition_of_fp32_groups", []),  # ZeRO-1/2
                   *getattr(opt, "fp32_partitioned_groups_flat", []),  # ZeRO-3
                   *(q for g in inner.param_groups for q in g["params"])]
        averaged = getattr(opt, "averaged_gradients", None) or {}
        grads = [p.grad for p in module_params] + [q.grad for q in masters]
        grads += [getattr(opt, "grad_partitions_flat_buffer", None), getattr(opt, "grads_in_partition", None)]
        for value in averaged.values():
            grads += value if isinstance(value, list) else [value]
        return {
            # ZeRO-3 keeps each parameter's local partition in ds_tensor (the parameter itself is
            # empty between uses); ZeRO-1/2 parameters are views into one flat 16/32-bit buffer.
            "parameter": [p if getattr(p, "ds_persist", False) else getattr(p, "ds_tensor", p) for p in module_params],
            "optimizer_state": masters + [v for state in inner.state.values() for v in state.values()
                                          if torch.is_tensor(v)],
            "gradient": [g for g in grads if torch.is_tensor(g)],
        }

    def gathered_root(self) -> nn.Module:
        return self.engine.module

    def gathered_bytes(self) -> int:
        """After forward: ZeRO-3 parameters still gathered (with stage3_max_live_parameters and
        max_reuse_distance at their 1e9 defaults, DeepSpeed keeps them until backward reuses them).
        Parameters under stage3_param_persistence_threshold stay whole on every rank and are
        counted with `params` instead."""
        storages = {}
        for p in self.engine.module.parameters():
            if hasattr(p, "ds_tensor") and not getattr(p, "ds_persist", False) and p.data.numel():
                storage = p.data.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def breakdown_tensors(self) -> dict[str, list[torch.Tensor]]:
        # Gathered ZeRO-3 parameters are parameters too, for the memory breakdown (model state
        # at rest stays the shards: state_tensors).
        tensors = self.state_tensors()
        tensors["parameter"] = tensors["parameter"] + [p.data for p in self.engine.module.parameters()]
        return tensors


class DeepSpeedBackend(Backend):
    name = "deepspeed"
    owned_flags = ("deepspeed_config", "deepspeed", "nvme_path")
    checkpoint_format = DEEPSPEED_FORMAT
    launcher = "deepspeed"  # `deepspeed --num_gpus N train.py ...`
    config_flag, config_files, needs_config_file = "deepspeed_config", "ds_configs/*.json", True
    ckpt_impls = DEEPSPEED_CKPT_IMPLS
    swap_flag = "nvme_path"
    CHECKPOINT_TAG = "ckpt"

    @classmethod
    def resolve(cls, cfg, env) -> Resolved:
        if cfg.deepspeed_config is None:
            raise ConfigError("backend deepspeed needs --deepspeed_config (a JSON file; see ds_configs/)")
        spec = deepspeed_spec.spec_of(cfg, env.world_size, env.device.type)
        return cls.resolved(dataclasses.replace(
            cfg, micro_batch=spec.micro_batch, grad_accum=spec.grad_accum, precision=spec.precision, lr=spec.lr,
            lr_warmup_steps=spec.lr_warmup_steps, grad_clip=spec.grad_clip), env, spec=spec)

    @classmethod
    def memory_layout(cls, world, precision, options=None, ranks_per_node=None) -> Layout:
        """`options`: the DeepSpeed config (its zero_optimization section is what counts)."""
        zero = (options or {}).get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        offload = any(((zero.get(k) or {}).get("device") or "none") != "none"
                      for k in ("offload_optimizer", "offload_param"))
        kind = {0: "replicated", 1: "zero12", 2: "zero12", 3: "zero3"}[stage]
        hpz = int(zero.get("zero_hpz_partition_size") or 1) if stage == 3 else 1
        return Layout(kind, world, offload=offload, compute_bytes=compute_bytes(precision), ds=zero,
                      hpz=hpz if 1 < hpz < world else 1, master_in_optimizer=True, flat_allreduce=True,
                      offload_params=(zero.get("offload_param") or {}).get("device", "none") != "none")

    @classmethod
    def output_dirs(cls, cfg, spec) -> list[tuple[str, str]]:
        # DeepSpeed's monitors write where the file says.
        return monitor_paths(cfg.deepspeed_config, spec.config) if cfg.deepspeed_config and spec is not None else []

    @classmethod
    def swap_dirs(cls, spec) -> list[str]:
        """The NVMe directories the spec swaps into (ZeRO-Infinity)."""
        zero = (getattr(spec, "config", None) or {}).get("zero_optimization") or {}
        return sorted({zero[s]["nvme_path"] for s in ("offload_optimizer", "offload_param")
                       if (zero.get(s) or {}).get("device") == "nvme" and zero[s].get("nvme_path")})

    @classmethod
    def swaps(cls, config_file: str) -> bool:
        config = deepspeed_config.read(config_file)
        return "nvme" in (deepspeed_spec.offload_device(config, "offload_optimizer"),
                          deepspeed_spec.offload_device(config, "offload_param"))

    @classmethod
    def refuses_selective_checkpointing(cls, config_file: str | None) -> bool:
        return _zero_stage(config_file) == 3  # wrong gradients (deepspeed_spec.py)

    @classmethod
    def fake_world_growth(cls, cfg) -> tuple[str, str]:
        # ZeRO-3 keeps per-rank partition bookkeeping; ZeRO 0-2 grow like the collectives' rank lists.
        if not cfg.deepspeed_config:
            return super().fake_world_growth(cfg)
        stage = _zero_stage(cfg.deepspeed_config) or 0
        return ("zero3", "ZeRO-3") if stage == 3 else ("zero", f"ZeRO-{stage}")

    @classmethod
    def offload(cls, spec, n_params, world) -> tuple[bool, bool, float]:
        # ZeRO-0's CPU optimizer steps every parameter on every rank; ZeRO 1-3's, this rank's partition.
        return (spec.offload_optimizer != "none", spec.offload_param != "none",
                n_params / world if spec.stage > 0 else n_params)

    @classmethod
    def estimator_options(cls, spec, described) -> dict:
        return {"ds_config": spec["config"] if spec is not None else described["config"]}

    @classmethod
    def init_distributed(cls, env, timeout_s: float) -> None:
        ensure_rendezvous_env()  # plain `python train.py`: a world of one, not MPI discovery
        if env.device.type == "cuda":
            # Before any collective: NCCL binds each rank's communicator to its current device,
            # and the loop's first broadcast comes before deepspeed.initialize would set it.
            torch.cuda.set_device(env.device)
        import_deepspeed().init_distributed(dist_backend=env.comm_backend, auto_mpi_discovery=False,
                                            timeout=timedelta(seconds=timeout_s))
        if env.device.type == "cpu":
            # Every rank has mapped every rank's shared-memory allreduce buffer once all are here.
            torch.distributed.barrier()
            unlink_shm_allreduce_buffer(env.rank)

    @classmethod
    def loads_checkpoint_sharded(cls, spec) -> bool:
        return spec.stage == 3

    def build_model(self, workload, seed: int) -> nn.Module:
        """A checkpoint under ZeRO-3: built under zero.Init (each rank its partition) and loaded module
        by module (models/pretrained.py); otherwise whole, as every backend."""
        if workload.pretrained is not None and self.loads_checkpoint_sharded(self.spec):
            import_deepspeed()
            with LoadPeak(self.env.device, workload.pretrained.checkpoint.file_sizes()) as self.load_peak:
                return workload.pretrained.zero3(self.spec.config, self.env.rank)
        return super().build_model(workload, seed)

    def setup(self, model: nn.Module) -> None:
        deepspeed = import_deepspeed()
        cfg, spec = self.cfg, self.spec
        blocks = self.prepare_blocks(model)  # before initialize, as for the torch backends
        # ds_numel: a parameter built under zero.Init is empty here, its size DeepSpeed's.
        self.largest_layer_params = max(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        if cfg.ckpt_impl.startswith("deepspeed"):
            deepspeed.checkpointing.configure(None, deepspeed_config=spec.config)
            wrapper = deepspeed_wrapper(cfg.ckpt_impl)
        else:
            wrapper = None
        # Before initialize: ZeRO-3 partitions the parameters, the wrappers only move modules.
        self.offloader = make_offloader(cfg, self.env.device, model, blocks)
        self.activation_checkpointing = apply_ac(model, blocks, cfg.ckpt_interval, cfg.ckpt_impl, cfg.ckpt_offload,
                                                 wrapper=wrapper, offloader=self.offloader, policy=cfg.ckpt_policy,
                                                 save_ops=cfg.save_ops(),
                                                 choices=cfg.ckpt_choices(len(blocks)) if cfg.ckpt_plan is not None else None)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=spec.config)
        # DeepCompile (the config's compile block, {"deepcompile": true}): DeepSpeed compiles the
        # whole engine with its ZeRO passes; engine.compile() is what turns it on.
        self.deepcompile = bool((spec.config.get("compile") or {}).get("deepcompile"))
        if self.deepcompile:
            self.engine.compile()
        self.model = self.engine
        self._last_micro_step = True

    def micro_step(self, sync: bool):
        # The engine accumulates by itself (gradient_accumulation_steps); it only needs to know
        # which micro-step is the last, and engine.step() after every backward.
        self._last_micro_step = sync
        return contextlib.nullcontext()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = self.engine(x, y)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # scales by 1 / gradient_accumulation_steps itself
        if not self._last_micro_step:
            self.engine.step()  # not a boundary: the engine only counts the micro-step

    def step(self) -> None:
        self.engine.step()

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def accounting(self) -> MemoryAccounting:
        return DeepSpeedAccounting(self.engine)

    def comm_theory(self, n_params: int, trainable: int | None = None, buffers: dict | None = None) -> dict:
        """The ZeRO paper's accounting: stage 0 all-reduces the gradients (2 Psi (N-1)/N); stages 1
        and 2 reduce-scatter them and all-gather the updated parameters (2 Psi (N-1)/N); stage 3
        gathers the parameters for forward and again for backward and reduce-scatters the gradients
        (3 Psi (N-1)/N). ZeRO++ quantizes the gathered weights (qwZ: int8) and the reduced gradients
        (qgZ: int4) where it applies, and with hpZ (zero_hpz_partition_size) backward gathers from a
        secondary partition inside groups of that many ranks. Stage 3 gathers every micro-step; reductions follow the stage.
        Gradients, and stages 1-2's updated shards, of the trainable parameters alone (frozen ones
        are in no optimizer group); stage 3 partitions and gathers every parameter."""
        spec, n, accum = self.spec, self.env.world_size, self.cfg.grad_accum
        if n == 1:
            return super().comm_theory(n_params, trainable)
        grads = n_params if trainable is None else trainable
        zero = spec.config.get("zero_optimization") or {}
        c = _element_bytes(spec.precision)
        weights = 1 if zero.get("zero_quantized_weights") else c
        reduced = 0.5 if zero.get("zero_quantized_gradients") else c
        per_node = self.env.local_world_size
        if spec.stage == 0:
            return comm.theory("all-reduce of the gradients: 2 Psi (N-1)/N", {"all_reduce": (grads, c, n)}, n, per_node)
        if spec.stage in (1, 2):
            reductions = accum if spec.stage == 2 else 1
            return comm.theory("reduce-scatter of the gradients, all-gather of the parameters: 2 Psi (N-1)/N",
                               {"reduce_scatter": (reductions * grads, c, n), "all_gather": (grads, c, n)}, n, per_node)
        hpz = int(zero.get("zero_hpz_partition_size") or 1)
        if 1 < hpz < n:  # ZeRO++ hpZ: backward gathers from the secondary partition, inside groups of hpz ranks
            return comm.theory(f"all-gather for forward, again for backward in groups of {hpz} (hpZ), reduce-scatter",
                               {"all_gather": (accum * n_params, weights, n),
                                "all_gather:secondary": (accum * n_params, weights, hpz),
                                "reduce_scatter": (accum * grads, reduced, n)}, n, per_node)
        return comm.theory("all-gather for forward and backward, reduce-scatter: 3 Psi (N-1)/N",
                           {"all_gather": (2 * accum * n_params, weights, n),
                            "reduce_scatter": (accum * grads, reduced, n)}, n, per_node)

    def comm_schedule(self, param_sizes: list[int], buffers: dict | None = None) -> dict[str, tuple[float | None, float]]:
        """What DeepSpeed 0.19 does with comm_theory's collectives (elements; its defaults where the
        file is silent). Stage 0 all-reduces the engine's fixed 5e8 elements at a time
        (MEMORY_OPT_ALLREDUCE_SIZE) after backward: it waits. Stages 1-2 reduce reduce_bucket_size at
        a time, overlapping backward only with overlap_comm (off by default below stage 3), and
        all-gather the updated parameters in the optimizer step, one call per parameter group
        (all_gather_into_tensor: allgather_bucket_size is not read): it waits. Stage 3 gathers each
        module's parameters as it is used, with the next modules' up to stage3_prefetch_bucket_size
        fetched ahead; with a prefetch bucket of 0 nothing is fetched ahead and forward's gathers
        wait (backward's mostly find the parameters still gathered: stage3_max_reuse_distance).
        Its calls follow the modules, not a bucket size: the projection's bucket size prices them."""
        spec = self.spec
        zero = spec.config.get("zero_optimization") or {}
        c = _element_bytes(spec.precision)
        if spec.stage == 0:
            return {"all_reduce": (c * 5e8, 1.0)}
        reduce_bytes = 0.5 if spec.stage == 3 and zero.get("zero_quantized_gradients") else c  # qgZ: int4
        reduction = reduce_bytes * float(zero.get("reduce_bucket_size", 5e8))
        overlapped = spec.stage == 3 if zero.get("overlap_comm") is None else bool(zero["overlap_comm"])
        if spec.stage in (1, 2):  # 0.19's reduction is counted as all-reduce (use_multi_rank_bucket_allreduce)
            reducing = (reduction, 0.0 if overlapped else 1.0)
            return {"reduce_scatter": reducing, "all_reduce": reducing, "all_gather": (math.inf, 1.0)}
        # DeepSpeed prefetches no more than stage3_max_live_parameters leaves room for: 0 of them, none.
        prefetch = min(float(zero.get("stage3_prefetch_bucket_size", 5e7)),
                       float(zero.get("stage3_max_live_parameters", 1e9)))
        return {"reduce_scatter": (reduction, 0.0 if overlapped else 1.0), "all_gather": (None, 0.0 if prefetch else 0.5)}

    def describe(self) -> dict:
        spec = self.spec
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters())
        return {
            "name": self.name,
            "activation_checkpointing": self.activation_checkpointing,
            "compile": self.compiled,
            "deepcompile": self.deepcompile,
            "zero_stage": spec.stage,
            "offload_optimizer": spec.offload_optimizer,
            "offload_param": spec.offload_param,
            "optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
            "optimizer_wrapper": type(opt).__name__,
            "master_dtype": "fp32",
            "compute_dtype": spec.precision,
            "reduce_dtype": spec.config.get("communication_data_type") or spec.precision,
            "loss_scaling": "dynamic (DeepSpeed)" if spec.precision == "fp16" else None,
            "model_state_estimate": model_state_estimate(
                spec.stage, n_params, self.largest_layer_params, self.env.world_size, self.env.local_world_size,
                spec.offload_optimizer, spec.offload_param),
        }

    def save_checkpoint(self, directory: Path) -> None:
        # The engine's own format: module, ZeRO partitions (optimizer state, fp32 master weights)
        # and LR scheduler; deepspeed.utils.zero_to_fp32 consolidates it (training/export.py).
        self.engine.save_checkpoint(str(directory), tag=self.CHECKPOINT_TAG)

    def load_checkpoint(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag=self.CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {directory}")
        replay_adam_step_count(self.engine.optimizer)  # bit-exact resume (backends/deepspeed_support.py)

    def teardown(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.destroy()
        self.engine = self.model = self.optimizer = self.scheduler = None


def _zero_stage(config_file: str | None) -> int | None:
    """The ZeRO stage a DeepSpeed config file names (None: none named, or no file)."""
    config = deepspeed_config.read(config_file) if config_file else {}
    return (config.get("zero_optimization") or {}).get("stage")
