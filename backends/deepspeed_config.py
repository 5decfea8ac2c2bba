"""DeepSpeed JSON configs: reading and validation.

A file is read as DeepSpeed reads it (hjson, which allows comments and trailing commas, with
duplicate keys refused), and every value this suite reads itself is checked for its type (a
number is a number, not "0.001") and for being finite, with errors naming the file and key.

DeepSpeed checks its pydantic sections (zero_optimization, bf16, ...) but silently ignores
unknown top-level keys and typos inside `activation_checkpointing`, `optimizer` and `scheduler`
(DeepSpeed issues 774, 1809). `validate` checks those itself, then runs DeepSpeed's own parser,
and reports the first problem in one line naming the file and key. backends/deepspeed_spec.py
turns a valid file and the command line into the config a run uses.
"""

from __future__ import annotations

import base64
import difflib
import math
import os
import re
from pathlib import Path

from core.configfile import NESTING_ALLOWED, check_json_nesting
from gptlite.errors import ConfigError

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
# Values DeepSpeed reads with no check of its own (get_scalar_param, dict lookups): a wrong type or
# value is accepted by its parser and fails after the run has started, at the first step
# (steps_per_print 0: ZeroDivisionError) or in deepspeed.initialize's asserts, or is coerced ("yes").
BOOLEAN_KEYS = ("prescale_gradients", "sparse_gradients", "zero_allow_untested_optimizer",
                "zero_force_ds_cpu_optimizer", "wall_clock_breakdown", "memory_breakdown", "dump_state",
                "disable_allgather")
# Sections DeepSpeed reads as objects (a list or a string there raises in its parser, naming no key).
OBJECT_SECTIONS = ("optimizer", "scheduler", "fp16", "bf16", "amp", "torch_autocast", "zero_optimization",
                   "activation_checkpointing", "aio", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
                   "comet", "compile", "data_types", "checkpoint", "timers", "elasticity", "autotuning")
ACTIVATION_CHECKPOINTING_BOOLEANS = ("partition_activations", "contiguous_memory_optimization",
                                     "cpu_checkpointing", "synchronize_checkpoint_boundary", "profile")
# The monitors that write files where output_path says (DeepSpeed makes the directory at the first step).
MONITORS = ("tensorboard", "csv_monitor", "wandb")
LIBAIO_HINT = ("install libaio, the Linux asynchronous I/O library DeepSpeed's async_io op builds on: "
               "`apt-get install libaio-dev` (Debian/Ubuntu) or `yum install libaio-devel` (RHEL/Fedora)")


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


INLINE_NAME = "(inline base64 config)"


def inline(value: str) -> str | None:
    """The JSON text of a --deepspeed_config given inline, base64-encoded, as DeepSpeed accepts it
    (deepspeed.initialize decodes any value that is not a file; its autotuner passes configs so);
    None when `value` is a path or not such a config."""
    if os.path.exists(value) or value.endswith((".json", ".hjson")):
        return None
    try:
        text = base64.urlsafe_b64decode(value.encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeError):  # binascii.Error is a ValueError
        return None
    return text if text.lstrip().startswith("{") else None


def shown(value: str) -> str:
    """`value` as messages and labels name it: the path, or "(inline base64 config)"."""
    return INLINE_NAME if inline(value) is not None else value


def read(path: str) -> dict:
    """The config in `path` (or given inline, base64-encoded), parsed as DeepSpeed parses it
    (hjson; duplicate keys refused)."""
    import hjson  # DeepSpeed's own dependency, and its parser

    text = inline(path)
    where = f"--deepspeed_config {path if text is None else INLINE_NAME}"
    if text is None:
        if not os.path.isfile(path):  # never raises (a name too long for the filesystem is not found)
            raise ConfigError(f"--deepspeed_config: file not found (nor a base64-encoded JSON config): {path}")
    try:
        text = Path(path).read_text() if text is None else text
        check_json_nesting(text, where)  # before hjson's decoder recurses into it
        data = hjson.loads(text, object_pairs_hook=_refuse_duplicates)
    except RecursionError:  # nested deeper than the count saw (brackets in unquoted hjson strings)
        raise ConfigError(f"{where}: nested too deeply: {NESTING_ALLOWED}") from None
    except _DuplicateKey as e:
        raise ConfigError(f"{where}: duplicate key '{e}' (DeepSpeed refuses duplicates)") from None
    except hjson.HjsonDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a JSON object (got {type(data).__name__})")
    _check_finite(where, data, "")
    return data


def _check_finite(where: str, value, key: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a finite number (got {value})")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(where, v, f"{key}.{k}" if key else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(where, v, f"{key}[{i}]")


def number(where: str, key: str, value, minimum: float | None = None, integer: bool = False,
           strictly_above: bool = False):
    """`value` checked as the number the file's `key` must hold; ConfigError naming file and key."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        expected = "an integer" if integer else "a number"
        raise ConfigError(f"{where}: {key} must be {expected} (got {value!r})")
    if minimum is not None and (value <= minimum if strictly_above else value < minimum):
        raise ConfigError(f"{where}: {key} must be {'>' if strictly_above else '>='} {minimum:g} (got {value!r})")
    return value


def _unknown(where: str, key: str, allowed) -> ConfigError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(allowed)}"
    return ConfigError(f"{where}: unknown key '{key}', which DeepSpeed would silently ignore ({hint})")


def validate(path: str, config: dict) -> None:
    """Raise ConfigError for the first problem in `config` (read from `path`)."""
    where = f"--deepspeed_config {shown(path)}"
    if "mesh" in config:
        raise ConfigError(f"{where}: mesh: DeepSpeed takes no device mesh; its sharding inside a node is "
                          "zero_optimization.zero_hpz_partition_size (ZeRO++ hpZ, ds_configs/zeropp_hpz.json)")
    for key in config:
        if key not in KNOWN_TOP_LEVEL_KEYS:
            raise _unknown(where, key, KNOWN_TOP_LEVEL_KEYS)
    for key in config.get("activation_checkpointing") or {}:
        if key not in ACTIVATION_CHECKPOINTING_KEYS:
            raise _unknown(where, f"activation_checkpointing.{key}", ACTIVATION_CHECKPOINTING_KEYS)
    _check_values(where, config)
    for section in ("optimizer", "scheduler"):
        if section not in config:
            continue
        value = config[section]
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
    _check_reduce_scatter(where, config)


def _check_values(where: str, config: dict) -> None:
    """The values DeepSpeed takes unchecked (BOOLEAN_KEYS, OBJECT_SECTIONS, ...): each of the type and
    range it needs, or a ConfigError naming the key."""
    for key in OBJECT_SECTIONS:
        if key in config and not isinstance(config[key], dict):
            raise ConfigError(f"{where}: {key} must be an object (got {config[key]!r})")
    for key in BOOLEAN_KEYS:
        if key in config and not isinstance(config[key], bool):
            raise ConfigError(f"{where}: {key} must be true or false (got {config[key]!r})")
    if "steps_per_print" in config:
        number(where, "steps_per_print", config["steps_per_print"], minimum=1, integer=True)
    if "gradient_predivide_factor" in config:
        number(where, "gradient_predivide_factor", config["gradient_predivide_factor"], minimum=0,
               strictly_above=True)
    checkpointing = config.get("activation_checkpointing") or {}
    for key in ACTIVATION_CHECKPOINTING_BOOLEANS:
        if key in checkpointing and not isinstance(checkpointing[key], bool):
            raise ConfigError(f"{where}: activation_checkpointing.{key} must be true or false "
                              f"(got {checkpointing[key]!r})")
    if checkpointing.get("number_checkpoints") is not None:
        number(where, "activation_checkpointing.number_checkpoints", checkpointing["number_checkpoints"],
               minimum=1, integer=True)
    for section in ("bf16", "fp16"):
        enabled = (config.get(section) or {}).get("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{where}: {section}.enabled must be true or false (got {enabled!r})")
    zero = config.get("zero_optimization") or {}
    device = ((zero.get("offload_param") or {}) if isinstance(zero, dict) else {}).get("device", "none")
    if device not in (None, "none") and zero.get("stage", 0) != 3:
        raise ConfigError(f"{where}: zero_optimization.offload_param is ZeRO-3's (DeepSpeed ignores it at stage "
                          f"{zero.get('stage', 0)}, and the record would say the parameters were offloaded): use "
                          "offload_optimizer, or stage 3")
    if (config.get("torch_autocast") or {}).get("enabled"):
        raise ConfigError(f"{where}: torch_autocast.enabled: a run's precision is --precision (or the file's bf16 "
                          "and fp16 sections), which its record states; DeepSpeed's torch_autocast would autocast "
                          "a run recorded as fp32 (use --precision bf16)")


def monitor_paths(path: str, config: dict) -> list[tuple[str, str]]:
    """(where, directory) of each enabled monitor (MONITORS) that writes under an output_path: the run
    checks it can write there before it starts (DeepSpeed would fail at the first step)."""
    where = f"--deepspeed_config {shown(path)}"
    return [(f"{where}: {name}.output_path", section["output_path"]) for name in MONITORS
            if isinstance(section := config.get(name), dict) and section.get("enabled")
            and isinstance(section.get("output_path"), str) and section["output_path"]]


def _check_reduce_scatter(where: str, config: dict) -> None:
    """DeepSpeed 0.19's ZeRO-2 and ZeRO-3 reduce-scatter the gradients (reduce_scatter, the default)
    only post-scaled and divided by the world: anything else fails an assert in deepspeed.initialize."""
    zero = config.get("zero_optimization") or {}
    if zero.get("stage", 0) not in (2, 3) or not zero.get("reduce_scatter", True):
        return
    if config.get("prescale_gradients"):
        raise ConfigError(f"{where}: prescale_gradients true is not supported by ZeRO-{zero['stage']} with "
                          "zero_optimization.reduce_scatter (DeepSpeed asserts it): leave it false")
    if config.get("gradient_predivide_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: gradient_predivide_factor must be 1.0 with ZeRO-{zero['stage']} and "
                          f"zero_optimization.reduce_scatter (DeepSpeed asserts it; got "
                          f"{config['gradient_predivide_factor']!r})")


def _validate_with_deepspeed(where: str, config: dict) -> None:
    """DeepSpeed's own parser (its pydantic sections reject unknown keys and bad values)."""
    from backends import deepspeed_support  # torch: reading a file stays torch-free (a sweep, a Slurm job's wrapper)

    deepspeed_support.import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = {k: v for k, v in config.items() if k not in ("train_batch_size", "gradient_accumulation_steps")}
    probe["train_micro_batch_size_per_gpu"] = 1  # batch sizes are checked by batch_sizes
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
        return f"{location}: {_dedupe_choices(first.get('msg', ''))}"
    return " ".join(str(error).split()) or type(error).__name__


def _dedupe_choices(message: str) -> str:
    """pydantic lists an enum's values, aliases included ("0, 1, 2, 3 or 3"): each once."""
    match = re.match(r"(Input should be )(.*)", message)
    if not match:
        return message
    values = list(dict.fromkeys(v.strip() for v in re.split(r", | or ", match.group(2))))
    listed = values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"
    return match.group(1) + listed


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


def shipped_configs() -> list[Path]:
    return sorted((Path(__file__).resolve().parent.parent / "ds_configs").glob("*.json"))
