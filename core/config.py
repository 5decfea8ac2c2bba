"""The run configuration: one dataclass that is the single source of truth for `train.py`'s flags.

Each field carries its help text (training/cli.py turns the fields into argparse flags), and
`RunConfig.__post_init__` checks every value that does not depend on a backend, so a bad value
fails the same way whether it came from the command line, a sweep or a test. What a backend
decides (its config file, its options, the defaults it fills in) is checked by that backend's
`resolve` (backends/); a field that only some backends read is marked `backend_flag`, the backends
that read it name it (Backend.owned_flags), and the others refuse it. Errors are one line naming the field and what is allowed
(ConfigError); the command lines print them and exit with code 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields

import torch

from core import config_checks as checks
from core.config_checks import (CKPT_CHOICES, DEEPSPEED_CKPT_IMPLS, GPTLITE_ONLY, MAX_RUN_NAME,  # noqa: F401 - the API
                                MAX_SEED, TORCH_CKPT_IMPLS, TRACKERS, check_plain_name, tracker_names)
from core.sdpa import SDPA_KERNELS
from gptlite.errors import ConfigError
from gptlite.model import ATTENTION_IMPLS, PRESETS, GPTConfig, preset
from models.spec import ModelRequest, TextRequest, parse_model_args

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
CKPT_IMPLS = (*TORCH_CKPT_IMPLS, *DEEPSPEED_CKPT_IMPLS)
CKPT_POLICIES = ("full", "selective", "auto")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Defaults of the flags a backend's config file may set instead (DeepSpeed JSON, FSDP YAML).
DEFAULT_MICRO_BATCH = 8
DEFAULT_GRAD_ACCUM = 1
DEFAULT_LR = 1e-3
DEFAULT_LR_WARMUP_STEPS = 20
# DeepSpeed clips gradients at norm 1.0 unless its config says otherwise; every backend does the same.
DEFAULT_GRAD_CLIP = 1.0


def _flag(help: str, default=MISSING, *, choices=None, group: str = "training", **kw):
    return field(default=default, metadata={"help": help, "choices": choices, "group": group, **kw})


@dataclass
class RunConfig:
    # What to run.
    backend: str | None = _flag(
        "Training backend (each is described below). Default: inferred from --deepspeed_config or "
        "--fsdp_config, else single.", None, group="backend")
    deepspeed_config: str | None = _flag(
        "DeepSpeed JSON config (ds_configs/); implies --backend deepspeed.", None, group="backend",
        metavar="JSON", backend_flag=True)
    deepspeed: bool = _flag("Accepted for DeepSpeed scripts' conventions; --deepspeed_config selects DeepSpeed.",
                            False, group="backend", backend_flag=True)
    local_rank: int | None = _flag(
        "Set by the deepspeed launcher; the rank's LOCAL_RANK environment variable is what counts.",
        None, group="backend")
    accelerate_plugin: str = _flag(
        "With --backend accelerate: Accelerator-managed DDP (none), or accelerate's FSDP or DeepSpeed "
        "plugin (GPUs only: accelerate supports neither on CPU).", "none",
        choices=("none", "fsdp", "deepspeed"), group="backend", backend_flag=True)
    nvme_path: str | None = _flag(
        "Directory on the NVMe drive for ZeRO-Infinity NVMe offload (ds_configs/z3_infinity_nvme.json).",
        None, group="backend", metavar="DIR", backend_flag=True)
    fsdp_config: str | None = _flag(
        "YAML file of FSDP or FSDP2 options (fsdp_configs/). Default for --backend fsdp: FULL_SHARD, "
        "fp32; for fsdp2: reshard after forward, fp32.", None, group="backend", metavar="YAML",
        backend_flag=True)
    ddp_bucket_cap_mb: float | None = _flag(
        "DistributedDataParallel's gradient bucket size in MiB (its bucket_cap_mb): gradients are all-reduced a "
        "bucket at a time as backward fills them, so smaller buckets start sooner and leave less to wait for after "
        "backward, at more calls. Default: DDP's own, 25 MiB after a first bucket of 1 MiB (given, every bucket "
        "is this size, the first too); the planner's --variants tries a quarter and four times 25.", None,
        group="backend", metavar="MIB", backend_flag=True)
    find_unused_parameters: bool = _flag(
        "DistributedDataParallel's find_unused_parameters, for a model that leaves parameters without a gradient "
        "in a step (a mixture of experts whose experts may get no token, an unused branch or parameter): DDP then "
        "waits for no gradient it will not get, and a parameter no rank used gets no update, as in one process. "
        "Such a model is refused under DDP without it, and under FSDP, FSDP2, DeepSpeed and accelerate.", False,
        group="backend", backend_flag=True)
    ckpt_interval: int = _flag(
        "Activation checkpointing of every k-th transformer block (block index %% k == 0); 0: off. "
        "--activation_checkpoint_interval is the same flag, by the article's name.",
        0, group="activation checkpointing", aliases=("--activation_checkpoint_interval",))
    ckpt_impl: str = _flag(
        "Checkpointing implementation: torch's non-reentrant or reentrant checkpoint_wrapper, or "
        "(DeepSpeed backend) deepspeed.checkpointing's checkpoint or non_reentrant_checkpoint.",
        "torch_nonreentrant", choices=CKPT_IMPLS, group="activation checkpointing")
    ckpt_policy: str = _flag(
        "What a checkpointed block keeps for backward. full: its inputs only, everything else is recomputed. "
        "selective: decided op by op (torch's selective checkpoint contexts, any model): the outputs of "
        "matmuls with a weight, convolutions and fused attention kernels are kept; norms, activations, "
        "elementwise ops, dropout (with the same masks) and the naive attention core (QK^T, softmax, AV: the "
        "T x T scores) are recomputed. Applies to the blocks --ckpt_interval picks; needs ckpt_impl "
        "torch_nonreentrant. auto: with --mem_budget_gb and without --ckpt_interval, none, selective or full "
        "for each block, the plan of least recompute cost (--ckpt_cost) whose estimated peak per rank fits "
        "the budget (estimator/checkpointing_plan.py, on the memory estimator), printed before training and recorded "
        "as --ckpt_plan.", "full", choices=CKPT_POLICIES, group="activation checkpointing")
    ckpt_cost: str = _flag(
        "With --ckpt_policy auto, what a block's recompute costs. measured: rank 0 times the real model's "
        "forward and backward at the run's micro-batch with no, full and selective checkpointing on this "
        "device (a few seconds) and every rank runs its plan; counted: the recomputed FLOPs (torch's "
        "FlopCounterMode), then bytes, nothing run (a model too large to build whole on one device is "
        "counted).", "measured", choices=("measured", "counted"), group="activation checkpointing")
    ckpt_plan: str | None = _flag(
        "What each block does, in order, comma-separated: none, selective or full (one per block, e.g. "
        "full,full,selective,none for 4 blocks); instead of --ckpt_interval. --ckpt_policy auto writes it.",
        None, group="activation checkpointing", metavar="CHOICE,...")
    ckpt_save_ops: str | None = _flag(
        "With --ckpt_policy selective: the aten ops whose outputs are kept, comma-separated (torch.ops.aten "
        "names, e.g. mm,addmm,convolution), instead of the default set (backends/activation_checkpointing.py "
        "SELECTIVE_SAVE_OPS). Everything else is recomputed.", None, group="activation checkpointing",
        metavar="OP,...")
    ckpt_offload: bool = _flag(
        "Keep the checkpointed blocks' saved inputs in host memory (torch's offload_wrapper), "
        "fetched back when backward reaches them.", False, group="activation checkpointing")
    # The model.
    model: str = _flag(
        "What to train: gptlite (the article's model, sized by --preset); hf:<model_type>, a Hugging Face "
        "transformers model built from its config with random weights (hf:gpt2, hf:llama: a causal LM on the "
        "text; hf:resnet, hf:vit: an image classifier on CIFAR-10-shaped data); torchvision:<name> where "
        "torchvision imports; or your own .py file or module with get_model() and get_dataset() "
        "(docs/models.md, 'Your own model').", "gptlite", group="model", metavar="MODEL")
    model_args: str | None = _flag(
        "Settings of a non-GPT-lite model, key=value separated by commas (values read as YAML): an HF config's "
        "fields (n_layer=2,n_embd=64 for gpt2; layer_type=basic,depths=[2,2,2,2] makes hf:resnet ResNet-18), "
        "or your get_model()'s keyword arguments.", None, group="model", metavar="K=V,...")
    # A transformers checkpoint, loaded with its weights (models/pretrained.py).
    model_name_or_path: str | None = _flag(
        "A transformers causal language model checkpoint to train from its weights, as transformers' run_clm.py "
        "takes it: a local directory (save_pretrained's output: config.json and safetensors weights) or a hub "
        "name (used only where it is in the local Hugging Face cache or the hub is reachable). Sets --model to "
        "pretrained (give no other --model); --block_size defaults to the preset's, at most the model's "
        "positions (docs/models.md, 'A pretrained checkpoint').", None, group="model", metavar="DIR_OR_NAME")
    preset: str = _flag(
        "GPT-lite's size preset; for hf: language models, their context length (the preset's block_size) "
        "unless --block_size is given. Image models and model files have no use for it (a sweep may set it "
        "across a model dimension); --block_size, which only sets a context length, is refused for them.",
        "small", choices=tuple(PRESETS), group="model")
    n_layer: int | None = _flag("Override the preset's number of transformer blocks.", None, group="model")
    n_embd: int | None = _flag("Override the preset's embedding width.", None, group="model")
    n_head: int | None = _flag("Override the preset's number of attention heads.", None, group="model")
    block_size: int | None = _flag(
        "Override the preset's context length (tokens per sample); for hf: text models, their context length "
        "(default: the preset's).", None, group="model")
    dropout: float | None = _flag(
        "Override the preset's dropout probability; for hf: models, every dropout probability of the config.",
        None, group="model")
    attention: str = _flag(
        "naive: explicit T x T attention scores (the article's memory profile); "
        "sdpa: torch's fused scaled_dot_product_attention. Same outputs.",
        "naive", choices=ATTENTION_IMPLS, group="model",
    )
    sdpa_kernel: str = _flag(
        "Which of torch's scaled_dot_product_attention kernels may run (core/sdpa.py): auto (torch's choice, "
        "its default), flash, efficient (CUDA), cudnn (CUDA) or math; for GPT-lite's --attention sdpa and any "
        "model that calls sdpa. benchmarks/sdpa_kernels.py times them at the model's shape.",
        "auto", choices=SDPA_KERNELS, group="model",
    )
    # Data and batch.
    data: str | None = _flag(
        "UTF-8 text file to train on (e.g. tiny-shakespeare's input.txt); for an image model, a CIFAR-10 "
        "directory (cifar-10-batches-bin, or with --trust_data cifar-10-batches-py). Default: the embedded "
        "generated corpus, or synthetic CIFAR-10-shaped images.", None, metavar="PATH",
    )
    trust_data: bool = _flag(
        "Read CIFAR-10's python version (cifar-10-batches-py) from --data: its batches are pickles, which can "
        "run code; with this flag they are read accepting arrays, lists and bytes only. The binary version "
        "(cifar-10-batches-bin) needs no flag.", False)
    # Tokenized text through Hugging Face datasets and a tokenizer (models/text_data.py): run_clm.py's flags.
    tokenizer_name: str | None = _flag(
        "The tokenizer of --train_file or --dataset_name: a local directory (a tokenizer's save_pretrained files) or "
        "a Hub name. Default: the checkpoint's (--model_name_or_path). hf:<type> models built from their config "
        "take its vocabulary size (len(tokenizer)).", None, group="data", metavar="PATH")
    dataset_name: str | None = _flag(
        "A dataset by its Hugging Face datasets name (needs the Hub, or HF_HUB_OFFLINE=1 and its cache) or a local "
        "directory of data files, tokenized instead of --data.", None, group="data", metavar="NAME")
    dataset_config_name: str | None = _flag(
        "The configuration of --dataset_name (e.g. wikitext-2-raw-v1).", None, group="data", metavar="NAME")
    train_file: str | None = _flag(
        "A local training file, tokenized instead of --data: .txt (a row per line), .json/.jsonl (JSON Lines), "
        ".parquet or .csv.", None, group="data", metavar="FILE")
    validation_file: str | None = _flag(
        "A local validation file (as --train_file). Default: the last --validation_split_percentage of the "
        "training rows.", None, group="data", metavar="FILE")
    text_column_name: str | None = _flag(
        "The column holding the text. Default: text.", None, group="data", metavar="COLUMN")
    validation_split_percentage: int = _flag(
        "Without --validation_file (or a validation split of --dataset_name): the last this many percent of the "
        "training rows are the validation rows, the same every run.", 5, group="data", metavar="PERCENT")
    pad_to_block_size: bool = _flag(
        "One row per sample, cut to --block_size + 1 tokens and padded (labels -100 on padding: the loss is the "
        "mean over the global batch's real targets, on every backend), instead of run_clm.py's packing (the "
        "rows' tokens joined and cut into --block_size samples).", False, group="data")
    overwrite_cache: bool = _flag(
        "Tokenize again instead of reading the tokenized data cached in $GPTLITE_CACHE/datasets.", False,
        group="data")
    steps: int = _flag("Optimizer steps to run.", 50)
    micro_batch: int | None = _flag(
        f"Samples per rank per micro-step. Default: the DeepSpeed config's, else {DEFAULT_MICRO_BATCH}.", None)
    grad_accum: int | None = _flag(
        "Micro-steps per optimizer step (gradient accumulation). Default: the DeepSpeed config's, "
        f"else {DEFAULT_GRAD_ACCUM}.", None)
    precision: str | None = _flag(
        "fp32, or mixed precision with fp32 master weights: bf16, or fp16 with loss scaling. "
        "Overrides the precision of a --fsdp_config or --deepspeed_config file. Default: the file's, "
        "else fp32.",
        None, choices=PRECISIONS,
    )
    grad_clip: float | None = _flag(
        "Clip the global gradient norm to this (0: no clipping), in every backend. Default: the DeepSpeed "
        f"config's gradient_clipping, else {DEFAULT_GRAD_CLIP} (DeepSpeed's own default).", None)
    seed: int = _flag("Seed for the weights and the data order.", 1337)
    lr: float | None = _flag(
        "Peak learning rate of AdamW (betas 0.8/0.999, eps 1e-8, weight decay 3e-7). Default: the "
        f"DeepSpeed config's, else {DEFAULT_LR}.", None)
    lr_warmup_steps: int | None = _flag(
        "Steps of linear learning-rate warm-up from 0 to --lr (DeepSpeed's WarmupLR, step for step); "
        f"0: none. Default: the DeepSpeed config's, else {DEFAULT_LR_WARMUP_STEPS}.", None)
    # Measurement.
    warmup_steps: int = _flag(
        "First steps left out of the timing (compilation, allocator warm-up).", 2, group="measurement")
    mem_profile_steps: int = _flag(
        "Last steps profiled with torch.profiler for live tensor bytes by category "
        "(the memory peak on CPU); left out of the timing. 0 turns it off.", 1, group="measurement")
    mem_budget_gb: float | None = _flag(
        "Memory budget per rank, GiB. CUDA: the allocator is capped there, so going over raises "
        "out-of-memory. CPU: a measured peak above it ends the run with status oom. With --ckpt_policy "
        "auto, also what the checkpointing plan is made for (its estimated peak fits it). Default: none.",
        None, group="measurement")
    eval_every: int = _flag(
        "Validation loss every N steps (0: only at the end).", 0, group="measurement")
    eval_batches: int = _flag(
        "Global batches of the validation split per evaluation.", 4, group="measurement")
    offload_activations: bool = _flag(
        "Keep the checkpointed blocks' saved inputs in (pinned) host memory, copied out asynchronously "
        "on a side stream and fetched back ahead of backward (--activation_loading_horizon).",
        False, group="activation checkpointing")
    activation_loading_horizon: int = _flag(
        "With --offload_activations: how many checkpointed blocks ahead backward fetches saved inputs "
        "(0: when backward asks for them, like --ckpt_offload).", 2, group="activation checkpointing")
    block_class: str | None = _flag(
        "The model's repeated block (what FSDP wraps, FSDP2 shards, checkpointing and --compile target), "
        "by class name. Default: found (core/blocks.py: the repeated module class holding the most "
        "parameters; GPT-lite's Block).", None, group="activation checkpointing")
    # Compilation.
    compile: bool = _flag(
        "torch.compile each block's forward in place, before the backend wraps the model (DDP's hooks "
        "and FSDP's gathers stay outside the compiled code; ZeRO-3's per-layer fetches break it; parameter "
        "names unchanged). The first step compiles; --warmup_steps keeps it out of the timing, and the "
        "record counts graphs, graph breaks, recompilations and compile seconds.",
        False, group="compilation")
    compile_backend: str = _flag(
        "torch.compile backend: inductor (generated kernels: what users run), aot_eager (graph capture "
        "and AOTAutograd without code generation: for debugging and fast checks), eager (capture only).",
        "inductor", choices=COMPILE_BACKENDS, group="compilation")
    compile_mode: str = _flag(
        "inductor's mode (reduce-overhead: CUDA graphs; max-autotune: kernel search).", "default",
        choices=COMPILE_MODES, group="compilation")
    compile_memory_budget: float | None = _flag(
        "With --compile (inductor): torch's activation memory budget for the compiled blocks "
        "(torch._functorch.config.activation_memory_budget), a fraction from 0 to 1: 1 (torch's default) "
        "keeps what the partitioner keeps by default; lower, it recomputes in backward the cheapest ops "
        "whose outputs it would keep until what it keeps fits that fraction; 0 recomputes all it can. "
        "The compiled counterpart of --ckpt_policy (inside each block, not instead of it).", None,
        group="compilation", metavar="F")
    # Checkpoints.
    save_dir: str | None = _flag(
        "Directory of training checkpoints (model, optimizer, schedule, RNG; each backend's own "
        "format).", None, group="checkpoints", metavar="DIR")
    save_every: int = _flag("Save a checkpoint every N steps (0: never).", 0, group="checkpoints")
    keep_checkpoints: int = _flag("Keep the newest K checkpoints, delete older ones (0: keep all).", 2,
                                  group="checkpoints")
    resume: bool = _flag(
        "Continue from the latest checkpoint in --save_dir, into the same run record (start fresh "
        "if there is none: what restarted workers of torchrun --max-restarts need).",
        False, group="checkpoints")
    init_from: str | None = _flag(
        "Start from a consolidated fp32 state dict (python -m training.export), e.g. one written by "
        "another backend: the weights and the step position, with a fresh optimizer.", None,
        group="checkpoints", metavar="FILE")
    trust_checkpoint: bool = _flag(
        "Load a checkpoint (--resume) or an export (--init_from) that has no manifest signed by you: another "
        "user's or machine's, or one from before checkpoints were signed (docs/checkpoints.md). Torch files are "
        "still read weights-only; DCP's metadata and DeepSpeed's files are pickles, which can run code.",
        False, group="checkpoints")
    # Where things go and how much is said.
    runs_dir: str = _flag("Directory for run records.", "runs", group="output", metavar="DIR")
    run_name: str | None = _flag(
        "Name of this run's record directory (default: backend, preset, time).", None, group="output")
    overwrite: bool = _flag("Replace an existing record of the same --run_name.", False, group="output")
    log_every: int = _flag("Write a metrics line every N steps.", 1, group="output")
    quiet: bool = _flag("No progress bar and no per-step lines.", False, group="output")
    tracker: str | None = _flag(
        "Also log to an experiment tracker, on rank 0: tensorboard (event files in the record's directory: "
        "tensorboard --logdir RUNS_DIR lays runs over each other, each named as its record), wandb (W&B, offline "
        "unless WANDB_MODE=online; its run is named as the record, and the run's output says how to sync it), or "
        "csv (metrics.csv in the record). Repeatable, or comma-separated: --tracker tensorboard,wandb. Per step: loss, "
        "learning rate, samples/s, step time, memory; validation loss; at the end the summary (MFU, peak memory); "
        "the resolved configuration as hyperparameters. docs/trackers.md.", None, group="output",
        metavar="{" + ",".join(TRACKERS) + "}", repeat=True)
    dry_run: bool = _flag(
        "Print the resolved configuration as JSON (with n_params) and exit without training.",
        False, group="output")
    # Where it runs.
    device: str = _flag("auto: CUDA when available, else CPU.", "auto", choices=DEVICES, group="distributed")
    dist_timeout_s: float = _flag(
        "Timeout of collective operations, so a rank that died fails the others instead of "
        "hanging them.", 300.0, group="distributed")

    def __post_init__(self):
        """Every value that does not depend on a backend, checked in this order (core/config_checks.py)."""
        checks.check_choices_and_counts(self)
        self.tracker = tracker_names(self.tracker)
        checks.check_saving_and_offload(self)
        checks.check_compile(self)
        checks.check_ckpt_policy(self)
        checks.check_ckpt_offload(self)
        checks.check_numbers(self)
        checks.check_model(self)

    def plan_choices(self) -> list[str]:
        """--ckpt_plan as a list, each entry checked ([] without one)."""
        if self.ckpt_plan is None:
            return []
        choices = [c.strip() for c in self.ckpt_plan.split(",")]
        for c in choices:
            if c not in CKPT_CHOICES:
                raise ConfigError(f"ckpt_plan: {c!r} is not a choice (one of {', '.join(CKPT_CHOICES)} per block, "
                                  "comma-separated)")
        return choices

    def ckpt_choices(self, blocks: int) -> list[str]:
        """What each of the model's `blocks` does: --ckpt_plan's entries (one per block, checked), or
        --ckpt_policy for the blocks --ckpt_interval picks and none elsewhere."""
        if self.ckpt_plan is not None:
            choices = self.plan_choices()
            if len(choices) != blocks:
                raise ConfigError(f"ckpt_plan has {len(choices)} entries; the model has {blocks} blocks (one of "
                                  f"{', '.join(CKPT_CHOICES)} per block)")
            return choices
        policy = self.ckpt_policy if self.ckpt_policy in ("full", "selective") else "full"
        return interval_choices(blocks, self.ckpt_interval, policy)

    @property
    def checkpointing(self) -> bool:
        """Whether any block may be checkpointed (--ckpt_interval, --ckpt_plan or --ckpt_policy auto)."""
        return bool(self.ckpt_interval) or self.ckpt_plan is not None or self.ckpt_policy == "auto"

    def save_ops(self) -> tuple[str, ...] | None:
        """--ckpt_save_ops as aten operator names, each checked against torch.ops.aten; None when not
        given (a selective checkpoint then keeps backends/activation_checkpointing.py's default set)."""
        if self.ckpt_save_ops is None:
            return None
        names = []
        for item in self.ckpt_save_ops.split(","):
            name = item.strip().removeprefix("aten.").split(".")[0]
            if not name or not isinstance(getattr(torch.ops.aten, name, None), torch._ops.OpOverloadPacket):
                raise ConfigError(f"ckpt_save_ops: {item.strip()!r} is not an aten operator (names as torch.ops.aten "
                                  "has them, comma-separated: mm,addmm,convolution,_scaled_dot_product_flash_attention)")
            names.append(name)
        return tuple(dict.fromkeys(names))

    def text_request(self) -> TextRequest | None:
        """The text data flags, or None without --train_file / --dataset_name (the character corpus)."""
        if self.train_file is None and self.dataset_name is None:
            return None
        # The tokenizer defaults to the checkpoint's (--model_name_or_path, where that flag exists).
        tokenizer = self.tokenizer_name or getattr(self, "model_name_or_path", None)
        return TextRequest(tokenizer, self.dataset_name, self.dataset_config_name, self.train_file,
                           self.validation_file, self.text_column_name, self.validation_split_percentage,
                           self.pad_to_block_size, self.overwrite_cache, self.quiet,
                           "tokenizer_name" if self.tokenizer_name else "model_name_or_path")

    def backend_specific(self) -> tuple[str, ...]:
        """The fields set away from their defaults that only some backends read (each backend names those
        it owns: Backend.owned_flags)."""
        return tuple(f.name for f in fields(self) if f.metadata.get("backend_flag") and getattr(self, f.name) != f.default)

    def model_dropout(self) -> float | None:
        """The model's dropout where known: GPT-lite's (its preset's, or --dropout), an hf: or user model's
        only as --dropout sets it (None: its own, not known here)."""
        return self.model_config().dropout if self.model == "gptlite" else self.dropout

    def model_config(self, vocab_size: int | None = None) -> GPTConfig:
        overrides = {name: getattr(self, name) for name in ("n_layer", "n_embd", "n_head", "block_size", "dropout")}
        return preset(self.preset, attention=self.attention, vocab_size=vocab_size, **overrides)

    def model_request(self) -> ModelRequest:
        """What the flags say about the model and its data (models.load builds it)."""
        return ModelRequest(self.model, parse_model_args(self.model_args), self.data, self.model_name_or_path,
                            seq_len=self.model_config().block_size, block_size_given=self.block_size is not None,
                            dropout=self.dropout if self.model != "gptlite" else None,
                            gptlite_config=lambda vocab_size: self.model_config(vocab_size=vocab_size),
                            trust_data=self.trust_data, text=self.text_request())

    def to_dict(self) -> dict:
        return asdict(self)


def interval_choices(blocks: int, interval: int, policy: str = "full") -> list[str]:
    """Each block's choice (CKPT_CHOICES) when --ckpt_interval picks them: `policy` for block i with
    i % interval == 0, none elsewhere (interval 0: none everywhere)."""
    return [policy if interval and i % interval == 0 else "none" for i in range(blocks)]


def plan_choices_under(zero_stage: int | None) -> tuple[str, ...]:
    """What a checkpointing plan (--ckpt_policy auto) may choose per block: none and full under ZeRO-3,
    where selective checkpointing is refused (backends/deepspeed_spec.py); all of CKPT_CHOICES else."""
    return ("none", "full") if zero_stage == 3 else CKPT_CHOICES


def describe_plan(choices: Sequence[str]) -> str:
    """A plan in one line: runs of equal choices, "full x2, selective x4"."""
    runs: list[list] = []
    for c in choices:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return ", ".join(f"{c} x{n}" if n > 1 else c for c, n in runs)



