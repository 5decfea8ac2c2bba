"""DeepSpeed JSON configs: validation, batch arithmetic, and the config a run actually uses.

DeepSpeed checks its pydantic sections (zero_optimization, bf16, ...) but silently ignores
unknown top-level keys and typos inside `activation_checkpointing`, `optimizer` and `scheduler`
(DeepSpeed issues 774, 1809). `validate` checks those itself, then runs DeepSpeed's own parser,
and reports the first problem in one line naming the file and key.

`plan` turns a file and the command line into the effective config: batch sizes, precision,
learning rate and warm-up from the flags when given; what cannot run on this machine switched off
with a note that the run record keeps.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from gptlite.model import ConfigError

# Top-level keys DeepSpeed 0.19 reads (each appears in its source; tests check that it still does).
KNOWN_TOP_LEVEL_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "scheduler", "fp16", "bf16", "amp", "torch_autocast", "gradient_clipping", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "activation_checkpointing", "aio", "steps_per_print",
    "wall_clock_breakdown", "dump_state", "flops_profiler", "communication_data_type",
    "seq_parallel_communication_data_type", "memory_breakdown", "tensorboard", "wandb", "csv_monitor",
    "comet", "elasticity", "autotuning", "checkpoint", "data_efficiency", "curriculum_learning",
    "compression_training", "data_types", "pipeline", "disable_allgather", "graph_harvesting", "compile",
    "timers", "nebula", "weight_quantization", "hybrid_engine", "sparse_attention", "eigenvalue",
    "progressive_layer_drop", "quantize_training", "gradient_accumulation_dtype",
)
ACTIVATION_CHECKPOINTING_KEYS = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                                 "number_checkpoints", "synchronize_checkpoint_boundary", "profile")
SECTION_KEYS = ("type", "params")
ADAM_PARAM_KEYS = ("lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "bias_correction",
                   "amsgrad", "fp32_optimizer_states")
WARMUP_PARAM_KEYS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration",
                     "total_num_steps")
KNOWN_PARAMS = {"Adam": ADAM_PARAM_KEYS, "AdamW": ADAM_PARAM_KEYS, "WarmupLR": WARMUP_PARAM_KEYS,
                "WarmupDecayLR": WARMUP_PARAM_KEYS}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
LIBAIO_HINT = ("install libaio, the Linux asynchronous I/O library DeepSpeed's async_io op builds on: "
               "`apt-get install libaio-dev` (Debian/Ubuntu) or `yum install libaio-devel` (RHEL/Fedora)")


def read(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--deepspeed_config: file not found: {path}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") \
            from None
    except UnicodeDecodeError:
        raise ConfigError(f"--deepspeed_config {path}: not UTF-8 text") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed_config {path}: must be a JSON object (got {type(data).__name__})")
    return data


def _unknown(where: str, key: str, allowed) -> ConfigError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(allowed)}"
    return ConfigError(f"{where}: unknown key '{key}', which DeepSpeed would silently ignore ({hint})")


def validate(path: str, config: dict) -> None:
    """Raise ConfigError for the first problem in `config` (read from `path`)."""
    where = f"--deepspeed_config {path}"
    for key in config:
        if key not in KNOWN_TOP_LEVEL_KEYS:
            raise _unknown(where, key, KNOWN_TOP_LEVEL_KEYS)
    for key in config.get("activation_checkpointing") or {}:
        if key not in ACTIVATION_CHECKPOINTING_KEYS:
            raise _unknown(where, f"activation_checkpointing.{key}", ACTIVATION_CHECKPOINTING_KEYS)
    for section in ("optimizer", "scheduler"):
        value = config.get(section)
        if value is None:
            continue
        if not isinstance(value, dict) or "type" not in value:
            raise ConfigError(f"{where}: {section} must be an object with a 'type' (and 'params')")
        for key in value:
            if key not in SECTION_KEYS:
                raise _unknown(where, f"{section}.{key}", SECTION_KEYS)
        allowed = KNOWN_PARAMS.get(value["type"])
        for key in (value.get("params") or {}) if allowed else ():
            if key not in allowed:
                raise _unknown(where, f"{section}.params.{key}", allowed)
    _validate_with_deepspeed(where, config)


def _validate_with_deepspeed(where: str, config: dict) -> None:
    """DeepSpeed's own parser (its pydantic sections reject unknown keys and bad values)."""
    from backends.deepspeed_support import import_deepspeed

    import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = {k: v for k, v in config.items() if k not in ("train_batch_size", "gradient_accumulation_steps")}
    probe["train_micro_batch_size_per_gpu"] = 1  # batch sizes are checked by resolve_batch
    try:
        DeepSpeedConfig(probe)
    except Exception as e:  # noqa: BLE001 - pydantic, assertions, ValueError: all mean a bad config
        unknown = _unknown_field(e, config)
        if unknown:
            path, allowed = unknown
            close = difflib.get_close_matches(path[-1], allowed, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(allowed)}"
            raise ConfigError(f"{where}: unknown key '{'.'.join(path)}' ({hint})") from None
        raise ConfigError(f"{where}: DeepSpeed rejects it: {_one_line(e, config)}") from None


def _unknown_field(error: Exception, config: dict) -> tuple[list[str], list[str]] | None:
    """(path of the key, the keys its section allows) when pydantic refused an unknown key."""
    errors = getattr(error, "errors", None)
    if not callable(errors) or errors()[0].get("type") != "extra_forbidden":
        return None
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    loc = [str(part) for part in errors()[0].get("loc", ())]
    path = _path_of(config, loc) if loc else None
    models, found = [DeepSpeedConfigModel], None
    while models and found is None:  # the section's model, by the name pydantic gives it
        model = models.pop()
        found = model if model.__name__ == getattr(error, "title", None) else None
        models.extend(model.__subclasses__())
    if path is None or found is None:
        return None
    return path, sorted(found.model_fields)


def _one_line(error: Exception, config: dict) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):  # pydantic ValidationError: name the field by its path in the file
        first = error.errors()[0]
        loc = [str(part) for part in first.get("loc", ())]
        path = _path_of(config, loc) if loc else None
        location = ".".join(path) if path else f"{getattr(error, 'title', '')} {'.'.join(loc)}".strip()
        return f"{location}: {first.get('msg')}"
    return " ".join(str(error).split()) or type(error).__name__


def _path_of(config: dict, loc: list[str]) -> list[str] | None:
    """Where in the config file pydantic's location (relative to one section) is: the section's keys
    prepended (DeepSpeed validates each section with its own model, so the error omits them)."""
    if not isinstance(config, dict):
        return None
    if loc[0] in config:
        return loc
    for key, value in config.items():
        inner = _path_of(value, loc)
        if inner:
            return [key, *inner]
    return None


def resolve_batch(config: dict, micro: int | None, accum: int | None, world: int, where: str) -> tuple[int, int, int]:
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


@dataclass
class Plan:
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


def plan(cfg, world_size: int, device_type: str) -> Plan:
    """The effective DeepSpeed config of run `cfg` (a RunConfig) at this world size and device."""
    path = cfg.deepspeed_config
    where = f"--deepspeed_config {path}"
    raw = read(path)
    validate(path, raw)
    config = copy.deepcopy(raw)
    notes: list[str] = []

    micro, accum, train_batch = resolve_batch(raw, cfg.micro_batch, cfg.grad_accum, world_size, where)
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum,
                  train_batch_size=train_batch)

    precision = cfg.precision or precision_of(raw)
    config["bf16"] = {**(raw.get("bf16") or {}), "enabled": precision == "bf16"}
    config["fp16"] = {**(raw.get("fp16") or {}), "enabled": precision == "fp16"}

    lr, warmup = _plan_optimizer(cfg, raw, config, where)
    # DeepSpeed clips at 1.0 when the file is silent (its default); say so explicitly.
    config["gradient_clipping"] = cfg.grad_clip if cfg.grad_clip is not None else raw.get("gradient_clipping", 1.0)

    zero = config.setdefault("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload_opt, offload_param = offload_device(config, "offload_optimizer"), offload_device(config, "offload_param")
    if "nvme" in (offload_opt, offload_param):
        _plan_nvme(cfg, zero, where, notes)
    if device_type == "cpu":
        for key in ("zero_quantized_weights", "zero_quantized_gradients"):
            if zero.get(key):
                zero[key] = False
                notes.append(f"zero_optimization.{key}: not applied; DeepSpeed {_version()} has no quantizer op on "
                             "the CPU accelerator (it raises 'This op had not been implemented on CPU backend')")
    _plan_checkpointing(cfg, config, stage, notes)
    return Plan(config, stage, micro, accum, precision, lr, warmup, config["gradient_clipping"], offload_opt,
                offload_param, notes)


def _plan_optimizer(cfg, raw: dict, config: dict, where: str) -> tuple[float, int]:
    """The suite's one optimizer and schedule, as DeepSpeed sections; (lr, warm-up steps).

    Every backend trains with AdamW (betas, eps and weight decay of backends.base) and a linear
    warm-up; a file that asks for something else would make a different experiment, so it is
    refused. The learning rate and warm-up length are run parameters: the flags when given,
    else the file's values.
    """
    from backends.base import ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY
    from training.config import DEFAULT_LR

    optimizer = raw.get("optimizer")
    if optimizer is None or optimizer.get("type") not in ("Adam", "AdamW"):
        raise ConfigError(f"{where}: optimizer.type must be AdamW (or Adam, which DeepSpeed runs as AdamW), "
                          "the optimizer every backend uses")
    params = optimizer.get("params") or {}
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
    lr = cfg.lr if cfg.lr is not None else params.get("lr", DEFAULT_LR)
    warmup = cfg.lr_warmup_steps if cfg.lr_warmup_steps is not None else scheduler_params.get("warmup_num_steps", 0)
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
    from backends.deepspeed_support import async_io_available

    if not async_io_available():
        raise ConfigError(f"{where}: NVMe offload needs DeepSpeed's async_io op, which cannot build here: "
                          + LIBAIO_HINT)
    notes.append(f"nvme_path: {path}")


def _plan_checkpointing(cfg, config: dict, stage: int, notes: list[str]) -> None:
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
    import importlib.metadata

    return importlib.metadata.version("deepspeed")


def shipped_configs() -> list[Path]:
    return sorted((Path(__file__).resolve().parent.parent / "ds_configs").glob("*.json"))
