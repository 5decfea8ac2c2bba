"""The config a DeepSpeed run actually uses: batch arithmetic, precision, optimizer, offload.

`spec_of` turns a --deepspeed_config file and the command line into the effective config: batch
sizes, precision, learning rate and warm-up from the flags when given; what cannot run on this
machine switched off with a note that the run record keeps. The DeepSpeedSpec is frozen: the backend, the
run record (config.json's `plan`) and the memory estimator all read this one object.
"""

from __future__ import annotations

import copy
import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path

from backends.base import ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY, BackendSpec
from backends.deepspeed_config import LIBAIO_HINT, number, read, shown, validate
from backends import deepspeed_support
from core.config import DEFAULT_LR
from gptlite.errors import ConfigError

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def batch_sizes(config: dict, micro: int | None, accum: int | None, world: int, where: str) -> tuple[int, int, int]:
    """(micro-batch per rank, accumulation steps, train_batch_size) for this run.

    --micro_batch / --grad_accum override the file and train_batch_size follows them; otherwise the
    file's values must satisfy train_batch_size = micro x accum x world, the assert DeepSpeed would
    fail on later, with a less helpful message.
    """
    tb = config.get("train_batch_size")
    mb = config.get("train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps")
    for name, value in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                        ("gradient_accumulation_steps", gas)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{where}: {name} must be a positive integer (got {value!r})")
    overridden = micro is not None or accum is not None
    if micro is None:
        micro = mb
    if accum is None:
        accum = gas
    if not overridden and tb is not None:
        if micro is None and accum is None:
            accum = 1
        if micro is None:
            micro, rest = divmod(tb, accum * world)
            if rest or micro < 1:
                raise ConfigError(f"{where}: train_batch_size {tb} is not divisible by gradient_accumulation_steps "
                                  f"{accum} x world size {world}")
        if accum is None:
            accum, rest = divmod(tb, micro * world)
            if rest or accum < 1:
                raise ConfigError(f"{where}: train_batch_size {tb} is not divisible by "
                                  f"train_micro_batch_size_per_gpu {micro} x world size {world}")
        if micro * accum * world != tb:
            raise ConfigError(
                f"{where}: train_batch_size {tb} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accum} x world size {world} (= {micro * accum * world}); "
                "fix the file or pass --micro_batch / --grad_accum")
    micro = micro if micro is not None else 8
    accum = accum if accum is not None else 1
    return micro, accum, micro * accum * world


def precision_of(config: dict) -> str:
    if (config.get("bf16") or {}).get("enabled"):
        return "bf16"
    if (config.get("fp16") or {}).get("enabled"):
        return "fp16"
    return "fp32"


def offload_device(config: dict, section: str) -> str:
    device = ((config.get("zero_optimization") or {}).get(section) or {}).get("device", "none")
    return device if device in OFFLOAD_DEVICES else "none"


@dataclass(frozen=True)
class DeepSpeedSpec(BackendSpec):
    """What a DeepSpeed run uses: the effective config and what was resolved into it."""

    config: dict
    stage: int
    micro_batch: int
    grad_accum: int
    precision: str
    lr: float
    lr_warmup_steps: int
    grad_clip: float
    offload_optimizer: str
    offload_param: str
    notes: list[str] = field(default_factory=list)


def spec_of(cfg, world_size: int, device_type: str) -> DeepSpeedSpec:
    """The effective DeepSpeed config of run `cfg` (a RunConfig) at this world size and device."""
    path = cfg.deepspeed_config
    where = f"--deepspeed_config {shown(path)}"
    raw = read(path)
    validate(path, raw)
    config = copy.deepcopy(raw)
    notes: list[str] = []

    micro, accum, train_batch = batch_sizes(raw, cfg.micro_batch, cfg.grad_accum, world_size, where)
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum,
                  train_batch_size=train_batch)

    precision = cfg.precision or precision_of(raw)
    config["bf16"] = {**(raw.get("bf16") or {}), "enabled": precision == "bf16"}
    config["fp16"] = {**(raw.get("fp16") or {}), "enabled": precision == "fp16"}

    lr, warmup = _plan_optimizer(cfg, raw, config, where)
    # DeepSpeed clips at 1.0 when the file is silent (its default); say so explicitly.
    config["gradient_clipping"] = cfg.grad_clip if cfg.grad_clip is not None else number(
        where, "gradient_clipping", raw.get("gradient_clipping", 1.0), minimum=0)

    zero = config.setdefault("zero_optimization", {})
    stage = number(where, "zero_optimization.stage", zero.get("stage", 0), minimum=0, integer=True)
    offload_opt, offload_param = offload_device(config, "offload_optimizer"), offload_device(config, "offload_param")
    if "nvme" in (offload_opt, offload_param):
        _plan_nvme(cfg, zero, where, notes)
    compile_block = config.get("compile")
    if isinstance(compile_block, dict) and compile_block.get("deepcompile"):
        if device_type != "cuda":
            raise ConfigError(f"{where}: compile.deepcompile needs a CUDA device (DeepSpeed {_version()} compiles "
                              "its DeepCompile op against CUDA); on this machine use ds_configs/z3_tuned.json")
        check_arch_list(where, os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if device_type == "cpu":
        for key in ("zero_quantized_weights", "zero_quantized_gradients"):
            if zero.get(key):
                zero[key] = False
                notes.append(f"zero_optimization.{key}: not applied; DeepSpeed {_version()} has no quantizer op on "
                             "the CPU accelerator (it raises 'This op had not been implemented on CPU backend')")
    _plan_checkpointing(cfg, config, stage, notes)
    return DeepSpeedSpec(config, stage, micro, accum, precision, lr, warmup, config["gradient_clipping"], offload_opt,
                offload_param, notes)


def _plan_optimizer(cfg, raw: dict, config: dict, where: str) -> tuple[float, int]:
    """The suite's one optimizer and schedule, as DeepSpeed sections; (lr, warm-up steps).

    Every backend trains with AdamW (betas, eps and weight decay of backends.base) and a linear
    warm-up; a file that asks for something else would make a different experiment, so it is
    refused. The learning rate and warm-up length are run parameters: the flags when given,
    else the file's values.
    """
    optimizer = raw.get("optimizer")
    if optimizer is None or optimizer.get("type") not in ("Adam", "AdamW"):
        raise ConfigError(f"{where}: optimizer.type must be AdamW (or Adam, which DeepSpeed runs as AdamW), "
                          "the optimizer every backend uses")
    params = optimizer.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: optimizer.params must be an object (got {params!r})")
    for key, expected in (("betas", list(ADAM_BETAS)), ("eps", ADAM_EPS), ("weight_decay", WEIGHT_DECAY)):
        if key in params and params[key] != expected:
            raise ConfigError(f"{where}: optimizer.params.{key} is {params[key]!r}; every backend uses {expected!r} "
                              "(backends/base.py)")
    if params.get("adam_w_mode") is False:
        raise ConfigError(f"{where}: optimizer.params.adam_w_mode false means Adam with L2 regularisation; "
                          "every backend uses AdamW")
    scheduler = raw.get("scheduler")
    scheduler_params = (scheduler or {}).get("params") or {}
    if scheduler is not None:
        if scheduler.get("type") != "WarmupLR" or scheduler_params.get("warmup_type", "log") != "linear":
            raise ConfigError(f"{where}: scheduler must be WarmupLR with warmup_type linear (DeepSpeed's default "
                              "is log), the schedule every backend follows")
    lr = cfg.lr if cfg.lr is not None else number(where, "optimizer.params.lr", params.get("lr", DEFAULT_LR),
                                                    minimum=0, strictly_above=True)
    # The warm-up starts from 0, set below (and ends at the learning rate, whatever warmup_max_lr says: the
    # rate is optimizer.params.lr's, or --lr's): a file starting it elsewhere would be silently overruled.
    if number(where, "scheduler.params.warmup_min_lr", scheduler_params.get("warmup_min_lr", 0)) != 0:
        raise ConfigError(f"{where}: scheduler.params.warmup_min_lr is {scheduler_params['warmup_min_lr']!r}; every "
                          "backend warms up from 0 (leave it out, or 0)")
    warmup = cfg.lr_warmup_steps if cfg.lr_warmup_steps is not None else number(
        where, "scheduler.params.warmup_num_steps", scheduler_params.get("warmup_num_steps", 0), minimum=0,
        integer=True)
    config["optimizer"] = {"type": optimizer["type"], "params": {
        **params, "lr": lr, "betas": list(ADAM_BETAS), "eps": ADAM_EPS, "weight_decay": WEIGHT_DECAY}}
    if warmup:
        config["scheduler"] = {"type": "WarmupLR", "params": {
            **scheduler_params, "warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": warmup,
            "warmup_type": "linear"}}
    else:
        config.pop("scheduler", None)  # constant learning rate, as the torch backends without warm-up
    return lr, warmup


def _plan_nvme(cfg, zero: dict, where: str, notes: list[str]) -> None:
    path = cfg.nvme_path
    for section in ("offload_optimizer", "offload_param"):
        part = zero.get(section) or {}
        if part.get("device") == "nvme":
            path = path or part.get("nvme_path")
    if not path or not Path(path).is_dir():
        raise ConfigError(f"{where}: offloads to NVMe; pass --nvme_path DIR, a directory on the NVMe drive "
                          f"(got {path!r}, which is not a directory)")
    for section in ("offload_optimizer", "offload_param"):
        if (zero.get(section) or {}).get("device") == "nvme":
            zero[section] = {**zero[section], "nvme_path": str(path)}
    if not deepspeed_support.async_io_available():
        raise ConfigError(f"{where}: NVMe offload needs DeepSpeed's async_io op, which cannot build here: "
                          + LIBAIO_HINT)
    notes.append(f"nvme_path: {path}")


def _plan_checkpointing(cfg, config: dict, stage: int, notes: list[str]) -> None:
    if stage == 3 and ("selective" in cfg.plan_choices() or (cfg.ckpt_interval and cfg.ckpt_policy == "selective")):
        # Measured (tests/support/ckpt_probe.py, GPT-lite tiny, 2 ranks): step 0's gradients exact, step 1's
        # off by up to 7%: the backward of a kept matmul reads a view of its weight that ZeRO-3 has
        # released and reused by then.
        raise ConfigError(
            f"ckpt_policy selective under ZeRO stage 3 gives wrong gradients in DeepSpeed {_version()} from the "
            "second step (a kept matmul's backward reads a weight ZeRO-3 has released); use ckpt_policy full, or "
            "ZeRO stage 0-2 (ckpt_policy auto plans with none and full there)")
    if not cfg.ckpt_interval or not cfg.ckpt_impl.startswith("deepspeed"):
        return
    if cfg.ckpt_impl == "deepspeed_nonreentrant" and stage == 3:
        raise ConfigError(
            f"ckpt_impl deepspeed_nonreentrant fails under ZeRO stage 3 in DeepSpeed {_version()} (backward raises "
            "'The size of tensor a (0) must match the size of tensor b': what it keeps for backward includes "
            "parameters ZeRO-3 has released); use deepspeed or torch_nonreentrant")
    if cfg.ckpt_offload:
        # DeepSpeed's own offload of checkpointed inputs. On a CPU-only machine it needs
        # partitioning too: without it, the "move" to host memory returns the same tensor, which
        # DeepSpeed then empties (0.19.8); with one model-parallel rank the partition is the whole
        # tensor, so partitioning changes nothing else.
        section = config.setdefault("activation_checkpointing", {})
        section.update(cpu_checkpointing=True, partition_activations=True)
        notes.append("--ckpt_offload: activation_checkpointing.cpu_checkpointing and partition_activations set")


def _version() -> str:
    return importlib.metadata.version("deepspeed")


def check_arch_list(where: str, arch_list: str | None) -> None:
    """DeepCompile builds DeepSpeed's dc op at the first step, for the targets TORCH_CUDA_ARCH_LIST names,
    and DeepSpeed reads each as numbers ("9.0", "9.0+PTX"): an arch-specific target such as Hopper's
    "9.0a" raised ValueError (int('0a')) at step 0 on an H200 whose image sets it (2026-12-04,
    runs/reference/nvidia-h200/gpu_best_mfu). Refused before anything runs instead."""
    if not arch_list:
        return
    for target in arch_list.replace(" ", ";").split(";"):
        if target and not all(part.split("+")[0].isdigit() for part in target.split(".")):
            raise ConfigError(f"{where}: compile.deepcompile builds DeepSpeed's dc op, and DeepSpeed {_version()} cannot "
                              f"read TORCH_CUDA_ARCH_LIST={arch_list!r} (target {target!r}); set it to plain "
                              "capabilities, e.g. TORCH_CUDA_ARCH_LIST=9.0")
