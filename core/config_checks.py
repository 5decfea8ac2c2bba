"""The checks of a run's flags that do not depend on a backend. RunConfig.__post_init__ (core/config.py)
runs them in order, so a bad value fails the same way whether it came from the command line, a sweep or
a test: one line naming the field and what is allowed (ConfigError). What a backend decides is checked
by that backend's `resolve` (backends/)."""

from __future__ import annotations

import math
import unicodedata
from dataclasses import fields

from gptlite.errors import ConfigError
from models.spec import PRETRAINED, check_name, kind_of, model_label, parse_model_args, text_file_builder

# Activation checkpointing implementations: torch's (every backend) and DeepSpeed's (its backend).
TORCH_CKPT_IMPLS = ("torch_nonreentrant", "torch_reentrant")
DEEPSPEED_CKPT_IMPLS = ("deepspeed", "deepspeed_nonreentrant")
CKPT_CHOICES = ("none", "selective", "full")  # what one block does, in a --ckpt_plan
TRACKERS = ("tensorboard", "wandb", "csv")  # training/trackers.py
MAX_SEED = 2**32 - 1  # numpy's and torch's seeds; the per-rank dropout seed is derived from it
MAX_RUN_NAME = 200  # a directory name, with room for the files and temporaries inside it
# GPT-lite's own size flags; other models are sized by --model_args.
GPTLITE_ONLY = ("n_layer", "n_embd", "n_head", "attention")


def tracker_names(value) -> str | None:
    """--tracker given once or more (a list from argparse), or comma-separated (a sweep's train_args): the
    names in order, each once, comma-joined; None for none."""
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    names = []
    for item in map(str, items):
        for name in (n.strip() for n in item.split(",")):
            if not name:  # "csv," is a typo, not a list of one: what was meant after the comma is not known
                got = f" in {item!r}" if item.strip() else ""
                raise ConfigError(f"tracker must be one of {', '.join(TRACKERS)} (got an empty name{got})")
            if name not in TRACKERS:
                raise ConfigError(f"tracker must be one of {', '.join(TRACKERS)} (got {name!r})")
            names.append(name)
    return ",".join(dict.fromkeys(names)) or None


def check_plain_name(field: str, name: str) -> None:
    """A name that becomes a directory (a run's record, a sweep's folder) and is printed in logs,
    tables and reports: not empty, no '/', not hidden, not too long, and no control characters (a
    newline breaks every line that names it; an escape sequence or a right-to-left override is
    acted on by the terminal that lists it)."""
    control = next((c for c in name if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if not name or "/" in name or name.startswith(".") or len(name) > MAX_RUN_NAME or control is not None:
        raise ConfigError(f"{field} must be a plain directory name of at most {MAX_RUN_NAME} characters, not "
                          "starting with '.', without '/' or control characters "
                          f"(got {_shorten(name)!r}{f': U+{ord(control):04X}' if control else ''})")


def check_choices_and_counts(cfg) -> None:
    """Every field with choices holds one of them; the counts are at least 1."""
    for f in fields(cfg):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) is not None and getattr(cfg, f.name) not in choices:
            raise ConfigError(
                f"{f.name} must be one of {', '.join(choices)} (got {getattr(cfg, f.name)!r})")
    at_least(cfg, 1, "steps", "micro_batch", "grad_accum", "log_every", "eval_batches")


def check_saving_and_offload(cfg) -> None:
    """Saving, resuming and the activations' offload: the flags each needs beside it."""
    if (cfg.save_every or cfg.resume) and not cfg.save_dir:
        raise ConfigError("save_every and resume need --save_dir")
    if cfg.resume and cfg.init_from:
        raise ConfigError("resume and init_from exclude each other: resume continues a run, init_from starts one "
                          "from exported weights")
    at_least(cfg, 0, "warmup_steps", "mem_profile_steps", "eval_every", "lr_warmup_steps", "seed",
              "ckpt_interval", "save_every", "keep_checkpoints", "activation_loading_horizon")
    default = {f.name: f.default for f in fields(cfg)}
    if cfg.keep_checkpoints != default["keep_checkpoints"] and not cfg.save_dir:
        raise ConfigError("keep_checkpoints needs --save_dir (it keeps the newest K checkpoints there)")
    if cfg.activation_loading_horizon != default["activation_loading_horizon"] and not cfg.offload_activations:
        raise ConfigError("activation_loading_horizon needs --offload_activations (how many blocks ahead backward "
                          "fetches the offloaded inputs)")
    if cfg.offload_activations and not cfg.ckpt_interval:
        raise ConfigError("offload_activations requires ckpt_interval > 0 (it offloads the checkpointed "
                          "blocks' inputs)")
    if cfg.offload_activations and cfg.ckpt_impl in DEEPSPEED_CKPT_IMPLS:
        raise ConfigError(f"offload_activations with ckpt_impl {cfg.ckpt_impl}: DeepSpeed's checkpoint keeps a "
                          "block's inputs outside autograd's saved tensors, where the offloader cannot reach them; "
                          "use ckpt_impl torch_nonreentrant or torch_reentrant (they run under DeepSpeed too), or "
                          "--ckpt_offload for DeepSpeed's cpu_checkpointing")
    if cfg.offload_activations and cfg.ckpt_offload:
        raise ConfigError("offload_activations and ckpt_offload are two ways of doing the same: choose one")
    if cfg.sdpa_kernel != "auto" and cfg.model == "gptlite" and cfg.attention != "sdpa":
        raise ConfigError(f"sdpa_kernel {cfg.sdpa_kernel} needs --attention sdpa (naive attention calls no sdpa kernel)")


def check_compile(cfg) -> None:
    """--compile and its options; a compile memory budget below 1 only where the model has no dropout."""
    if not cfg.compile and (cfg.compile_backend, cfg.compile_mode) != ("inductor", "default"):
        raise ConfigError("compile_backend and compile_mode need --compile")
    if cfg.compile_memory_budget is not None:
        if not cfg.compile or cfg.compile_backend != "inductor":
            raise ConfigError("compile_memory_budget needs --compile with compile_backend inductor (its "
                              "partitioner reads the budget; aot_eager's and eager keep everything)")
        if not 0 <= cfg.compile_memory_budget <= 1:
            raise ConfigError(f"compile_memory_budget must be between 0 and 1 (got {cfg.compile_memory_budget:g})")
        # Measured (GPT-lite tiny, CPU, inductor, budget 0, dropout 0.1): step 0's loss equal, step 1's
        # off by 2e-4: the recomputed dropout did not draw the forward's masks. Exact with dropout 0. So
        # below 1 only where dropout is known to be 0: GPT-lite's, or an hf: model's with --dropout 0
        # (which sets every dropout of its config); another model's own dropout is not known here.
        dropout = cfg.model_dropout()
        if cfg.compile_memory_budget < 1 and dropout != 0:
            if dropout is None and not cfg.model.startswith("hf:"):
                raise ConfigError(f"compile_memory_budget below 1 needs a model without dropout, and {cfg.model}'s "
                                  "is not known here: with dropout the compiled recompute draws other masks than "
                                  "the forward (wrong gradients); not supported for this model yet")
            raise ConfigError(f"compile_memory_budget below 1 with dropout "
                              f"{'(the model default)' if dropout is None else f'{dropout:g}'}: the compiled "
                              "recompute draws other dropout masks than the forward (wrong gradients); use "
                              "--dropout 0, or --ckpt_policy for checkpointing with dropout")
    if cfg.compile and cfg.compile_mode != "default" and cfg.compile_backend != "inductor":
        raise ConfigError(f"compile_mode {cfg.compile_mode} is inductor's; compile_backend {cfg.compile_backend} "
                          "has only the default mode")
    if cfg.compile and not cfg.warmup_steps and not cfg.dry_run:
        raise ConfigError("warmup_steps must be >= 1 with --compile: the first step compiles, and a timed "
                          "compile would be reported as training speed")


def check_ckpt_policy(cfg) -> None:
    """--ckpt_policy, --ckpt_plan and --ckpt_cost together, and what checkpointing with a policy excludes."""
    if cfg.ckpt_cost != "measured" and cfg.ckpt_policy != "auto":
        raise ConfigError("ckpt_cost applies to --ckpt_policy auto (it is what the plan weighs)")
    if cfg.ckpt_save_ops is not None and cfg.ckpt_policy == "full" and "selective" not in cfg.plan_choices():
        raise ConfigError("ckpt_save_ops needs --ckpt_policy selective (it names the ops a selective checkpoint keeps)")
    if cfg.ckpt_plan is not None:
        if cfg.ckpt_interval:
            raise ConfigError("ckpt_plan names every block's checkpointing: drop --ckpt_interval")
        if cfg.ckpt_policy == "selective":
            raise ConfigError("ckpt_plan names each block's policy (none, selective, full): drop --ckpt_policy")
        why = "ckpt_plan"
    elif cfg.ckpt_policy == "auto":
        if cfg.mem_budget_gb is None:
            raise ConfigError("ckpt_policy auto needs --mem_budget_gb (the peak per rank it plans for, in GiB)")
        if cfg.ckpt_interval:
            raise ConfigError("ckpt_policy auto chooses every block's checkpointing itself: drop --ckpt_interval")
        why = "ckpt_policy auto"
    elif cfg.ckpt_policy == "full":
        return
    else:
        why = f"ckpt_policy {cfg.ckpt_policy}"
        if not cfg.ckpt_interval:
            raise ConfigError(f"{why} requires ckpt_interval > 0 (it decides what the checkpointed blocks keep)")
    if cfg.ckpt_impl != "torch_nonreentrant":
        raise ConfigError(f"{why} needs ckpt_impl torch_nonreentrant (got {cfg.ckpt_impl}): torch's selective "
                          "checkpoint contexts run only inside the non-reentrant checkpoint")
    for flag in ("offload_activations", "ckpt_offload", "compile"):
        if getattr(cfg, flag):
            raise ConfigError(f"{why} with --{flag}: not supported yet (the kept op outputs would stay where "
                              "they are, untested); use --ckpt_policy full with it")
    cfg.save_ops()  # names checked


def check_ckpt_offload(cfg) -> None:
    """--ckpt_offload offloads what checkpointing keeps: it needs checkpointing."""
    if cfg.ckpt_offload and not cfg.ckpt_interval:
        raise ConfigError("ckpt_offload requires ckpt_interval > 0 (it offloads the checkpointed blocks' inputs)")


def check_numbers(cfg) -> None:
    """Finite, positive where they must be, and in range."""
    for name in ("mem_budget_gb", "grad_clip", "lr", "dist_timeout_s"):
        value = getattr(cfg, name)
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number (got {value})")
    if cfg.mem_budget_gb is not None and not cfg.mem_budget_gb > 0:
        raise ConfigError(f"mem_budget_gb must be > 0 (got {cfg.mem_budget_gb})")
    if cfg.grad_clip is not None and cfg.grad_clip < 0:
        raise ConfigError(f"grad_clip must be >= 0 (got {cfg.grad_clip}); 0 turns clipping off")
    if cfg.lr is not None and not cfg.lr > 0:
        raise ConfigError(f"lr must be > 0 (got {cfg.lr})")
    if not cfg.dist_timeout_s > 0:
        raise ConfigError(f"dist_timeout_s must be > 0 (got {cfg.dist_timeout_s})")
    if cfg.seed > MAX_SEED:
        raise ConfigError(f"seed must be in [0, {MAX_SEED}] (got {cfg.seed})")


def check_model(cfg) -> None:
    """The run's name, the model's flags and its data."""
    if cfg.run_name is not None:
        check_plain_name("run_name", cfg.run_name)
    cfg.model_config()  # checks the model overrides (n_embd divisible by n_head, ...)
    check_model_name_or_path(cfg)
    check_name(cfg.model)
    parse_model_args(cfg.model_args)
    check_text_data(cfg)
    if cfg.model != "gptlite":
        for name in GPTLITE_ONLY:
            if getattr(cfg, name) != _default(cfg, name):
                raise ConfigError(f"{name} applies to --model gptlite; set {model_label(cfg.model)}'s size "
                                  "with --model_args")


def check_text_data(cfg) -> None:
    """The text data flags (models/text_data.py) together, without reading anything."""
    source = cfg.train_file is not None or cfg.dataset_name is not None
    if cfg.train_file is not None and cfg.dataset_name is not None:
        raise ConfigError("train_file and dataset_name are two sources of training text: give one")
    if cfg.dataset_config_name is not None and cfg.dataset_name is None:
        raise ConfigError("dataset_config_name needs --dataset_name (it names one of the dataset's configurations)")
    if cfg.validation_file is not None and cfg.train_file is None:
        raise ConfigError("validation_file needs --train_file (the training rows)")
    if source and cfg.data is not None:
        flag = "train_file" if cfg.train_file is not None else "dataset_name"
        raise ConfigError(f"data and {flag} are two sources of training text: give one (--data is a character "
                          "corpus, --train_file and --dataset_name are tokenized)")
    for name in ("text_column_name", "validation_split_percentage", "pad_to_block_size", "overwrite_cache"):
        if getattr(cfg, name) != _default(cfg, name) and not source:
            raise ConfigError(f"{name} applies to tokenized text: give --train_file or --dataset_name")
    if cfg.tokenizer_name is not None and not source:
        raise ConfigError("tokenizer_name tokenizes --train_file or --dataset_name: give one of them")
    if not 1 <= cfg.validation_split_percentage <= 99:
        raise ConfigError(f"validation_split_percentage must be between 1 and 99 (got "
                          f"{cfg.validation_split_percentage})")
    split_given = cfg.validation_split_percentage != _default(cfg, "validation_split_percentage")
    if cfg.validation_file is not None and split_given:
        raise ConfigError("validation_split_percentage splits the training rows when there is no "
                          "--validation_file: give one or the other")
    if source and kind_of(cfg.model) in ("file", "module", "torchvision"):
        flag = "train_file" if cfg.train_file is not None else "dataset_name"
        where = "its get_dataset() provides the data" if kind_of(cfg.model) != "torchvision" \
            else "it is an image model"
        raise ConfigError(f"{flag}: tokenized text is for gptlite and hf: language models; {cfg.model}: {where}")
    for flag in ("train_file", "validation_file"):
        if getattr(cfg, flag) is not None:
            text_file_builder(flag, getattr(cfg, flag))
    if source and cfg.tokenizer_name is None and getattr(cfg, "model_name_or_path", None) is None:
        flag = "train_file" if cfg.train_file is not None else "dataset_name"
        raise ConfigError(f"{flag}: tokenized text needs a tokenizer: --tokenizer_name (a local directory of a "
                          "tokenizer's files, or a Hub name), or --model_name_or_path (the checkpoint's)")


def check_model_name_or_path(cfg) -> None:
    """--model_name_or_path names the model: --model becomes `pretrained` (kept so in the record, which
    reads back the same); another --model with it, or `pretrained` without it, is refused."""
    if cfg.model_name_or_path is not None:
        if cfg.model not in ("gptlite", PRETRAINED):
            raise ConfigError(f"model_name_or_path and --model {cfg.model} exclude each other: a checkpoint is "
                              "the model (drop --model, or drop --model_name_or_path to train "
                              f"{cfg.model})")
        if not cfg.model_name_or_path.strip():
            raise ConfigError("model_name_or_path is empty: give a checkpoint directory or a hub name")
        if cfg.init_from:
            raise ConfigError("init_from and model_name_or_path exclude each other: the checkpoint is the starting "
                              "weights (export a run with training.export and pass that directory as "
                              "--model_name_or_path)")
        cfg.model = PRETRAINED
    elif cfg.model == PRETRAINED:
        raise ConfigError("model pretrained needs --model_name_or_path (a checkpoint directory or hub name)")


def _default(cfg, name: str):
    return next(f.default for f in fields(cfg) if f.name == name)


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def at_least(cfg, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < minimum:
            raise ConfigError(f"{name} must be >= {minimum} (got {value})")
