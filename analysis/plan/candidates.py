"""The planner's candidates: the backend configurations (shipped, and the variants that change speed or
memory), micro-batch x accumulation and checkpointing, and the checks of the planner's own inputs."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

import models
from gptlite.errors import ConfigError
from core.blocks import find_blocks
from core.config import RunConfig
from backends import BACKEND_NAMES, REFERENCE, deepspeed_config, fsdp_config, get_backend, named_alone
from estimator.memory_model import DS_PERSISTENCE
from training.cli import build_parser
from training.preflight import writable_out
from analysis.project import CONFIG_FLAGS, config_flags, configurations as shipped, node_hybrid


REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


CKPT = ("none", "full/1", "full/2", "full/4", "selective/1", "selective/2")


# The estimator's error band the planner keeps free under the budget: its largest under-estimate on
# the planner's CPU grids (benchmarks/plan_regret.py, 2 ranks, micro-batch 4 x 2 and 8 x 1) was 13.6%
# (GPT-lite small, ZeRO-2 at 4 x 2, 2026-11-25) before gradient accumulation was counted; since, the
# grids' records (GPT-lite small twice, an HF Llama twice: 153 runs) are estimated within 11.2%
# (FSDP2 at 4 x 2: a reduce-scatter in flight on gloo's thread, 8.7% and 11.2% in identical runs).
MARGIN = 0.15


# Seconds a GPU runs the calibration's largest micro-batch before any is timed (calibrate).
WARM_S = 2.0


# train.py flags the planner chooses: a user gives the question (model, budget, batch), not the answer.
CHOSEN_FLAGS = (*CONFIG_FLAGS, "micro_batch", "grad_accum", "ckpt_interval", "ckpt_policy", "ckpt_plan", "mem_budget_gb",
                "ddp_bucket_cap_mb")


# The reference backend (backends.REFERENCE, imported here for the planner's modules): one process, no
# wrapper. A world of one runs it, and the calibration times train.py's step under it
# (analysis/plan/device.py): its step is every prediction's compute. --configs names it and the backends
# priced by name alone (backends.named_alone) without a configuration file.


# train.py flags of one run, not of the model: copied into every candidate's command, each would
# name the same record or checkpoint directory.
RUN_OWN_FLAGS = ("run_name", "save_dir", "resume")


def _check_config(config: str) -> None:
    """--configs: a backend's name, an FSDP/FSDP2 YAML file (fsdp_configs/) or a DeepSpeed JSON file
    (ds_configs/), read as train.py reads it: an accelerate config or any other YAML is refused here."""
    if config in named_alone():
        return
    allowed = (f"{', '.join(named_alone())}, or an fsdp_configs/*.yaml or ds_configs/*.json file (relative to the "
               "repository)")
    if not (config.endswith((".yaml", ".json")) and (REPO / config).is_file()):
        raise ConfigError(f"--configs {config}: must be {allowed}")
    if config.endswith(".yaml"):
        try:
            fsdp_config.load(str(REPO / config))
        except ConfigError as e:
            raise ConfigError(f"--configs {config}: not an FSDP configuration ({e}); must be {allowed}") from None
    else:
        deepspeed_config.validate(config, deepspeed_config.read(str(REPO / config)))


def _check_ckpt_within_blocks(ckpt: tuple[str, ...], given) -> None:
    """--ckpt full/K or selective/K: K at most the model's blocks (every K-th block from the first:
    a K beyond them checkpoints block 0 alone, what K = the blocks already says)."""
    n = len(find_blocks(models.load(given.model_request()).meta(), given.block_class))
    for c in ckpt:
        if c != "none" and int(c.split("/")[1]) > n:
            raise ConfigError(f"--ckpt {c}: K must be at most the model's {n} blocks (every K-th block from the first)")


def check_ckpt(ckpt: str) -> str:
    """A checkpointing candidate (--ckpt): none, full/K or selective/K (K >= 1); ConfigError else."""
    policy, _, k = ckpt.partition("/")
    if ckpt != "none" and (policy not in ("full", "selective") or not k.isdigit() or int(k) < 1):
        raise ConfigError(f"ckpt {ckpt!r}: must be none, full/K or selective/K (K >= 1)")
    return ckpt


# train.py's flags by field: each flag's type, for a flag variant's value ("ddp --ddp_bucket_cap_mb 100")
_FLAG_TYPES = {action.dest: action.type for action in build_parser()._actions}


@dataclass(frozen=True)
class Candidate:
    """One configuration of the run: a backend configuration, micro-batch x accumulation, checkpointing."""

    # single, ddp, fsdp, fsdp2, or an fsdp_configs/ or ds_configs/ file (relative to the repository); a
    # variant set by flags (DDP's buckets: variants()) follows with them, "ddp --ddp_bucket_cap_mb 100"
    config: str
    micro_batch: int
    grad_accum: int
    ckpt: str  # none, full/k, selective/k
    base: str | None = None  # the configuration a --variants file varies (it shares its refitted overhead)

    def __post_init__(self):
        check_ckpt(self.ckpt)

    def flags(self) -> list[str]:
        """train.py's flags for this candidate (besides the model's)."""
        entry, options = self.parts
        flags = [*config_flags(entry), *options, "--micro_batch", str(self.micro_batch),
                 "--grad_accum", str(self.grad_accum)]
        if self.ckpt != "none":
            policy, k = self.ckpt.split("/")
            flags += ["--ckpt_interval", k] + (["--ckpt_policy", "selective"] if policy == "selective" else [])
        return flags

    def run_config(self, model: RunConfig, **more) -> RunConfig:
        """The run's configuration: the model's (train.py's flags, parsed once) with this candidate's
        choices, field by field, as its flags() would set them, and `more`."""
        entry, options = self.parts
        flag, value = config_flags(entry)
        changes = {flag.lstrip("-"): value, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum}
        for name, value in zip(options[::2], options[1::2]):
            kind = _FLAG_TYPES.get(name.lstrip("-"))
            changes[name.lstrip("-")] = kind(value) if kind else value
        if self.ckpt != "none":
            policy, k = self.ckpt.split("/")
            changes["ckpt_interval"] = int(k)
            if policy == "selective":
                changes["ckpt_policy"] = "selective"
        return dataclasses.replace(model, **changes, **more)

    @property
    def file(self) -> str | None:
        """The configuration's file, if it has one."""
        return self.config if self.config.endswith((".yaml", ".json")) else None

    @property
    def parts(self) -> tuple[str, list[str]]:
        """(the file or backend's name, a flag variant's flags): a file's path may hold spaces."""
        if self.file:
            return self.config, []
        entry, *options = self.config.split(" ")
        return entry, options

    def run_name(self) -> str:
        """A name for its runs: z2-mb4x2-full2, ddp-ddp_bucket_cap_mb-100-mb8x1-none."""
        entry, options = self.parts
        label = "-".join([Path(entry).stem, *(o.lstrip("-") for o in options)])
        return f"{label}-mb{self.micro_batch}x{self.grad_accum}-{self.ckpt.replace('/', '')}"


def configurations(world: int, per_node: int) -> list[str]:
    """The backend configurations the suite ships, for `world` ranks `per_node` to a node."""
    if world == 1:
        return [REFERENCE]
    # The hybrid family where the world spans nodes; on one node it is FULL_SHARD again.
    return [c for c in shipped() if not (node_hybrid(c) and world <= per_node)]


def variants(config: str) -> list[tuple[str, dict]]:
    """(name, changed keys) of the variants of DDP (train.py flags) or of one fsdp_configs/ or
    ds_configs/ file (the file's keys) that change speed or memory in ways the step model prices and
    the estimator reads (all but FSDP's backward prefetch: that variant's peak is estimated as its
    file's, over): DDP's buckets a quarter and four times its default (more calls and less waiting
    after backward, or fewer and more: DDPBackend.comm_schedule); DeepSpeed ZeRO-1/2's
    reduce_bucket_size a quarter and four times the file's (more calls, or a larger bucket
    allocated); ZeRO-3 without prefetching (forward's gathers wait; no prefetch in flight) and with
    a persistence threshold 100 times the file's (more parameters kept whole on every rank: fewer
    bytes gathered, in DeepSpeed 0.19 in more calls; the estimator reads it; its speed is priced with
    --counted only, as the theory's bytes do not see it); FSDP
    resharding after forward without backward prefetch (backward's gathers wait). A larger ZeRO-3
    prefetch would change how much of the gathering overlaps, which the step model does not
    resolve: not planned. A file that does not parse has none (its own candidates say why train.py
    refuses it)."""
    if config in BACKEND_NAMES:  # named alone: its variants are train.py flags (DDP's buckets)
        return get_backend(config).planner_variants(None)
    if not config.endswith((".json", ".yaml")):
        return []
    source = _source(config)
    try:
        if config.endswith(".json"):
            zero = deepspeed_config.read(str(source)).get("zero_optimization") or {}
            if zero.get("stage", 0) in (1, 2):
                size = int(float(zero.get("reduce_bucket_size", 5e8)))
                return [(f"buckets_{name}", {"zero_optimization": {"reduce_bucket_size": max(2, int(size * f) // 2 * 2)}})
                        for name, f in (("quarter", 0.25), ("x4", 4))]
            if zero.get("stage") == 3:
                out = []
                prefetch = _number(zero.get("stage3_prefetch_bucket_size", 5e7))
                if prefetch is None or prefetch > 0:  # None: "auto", DeepSpeed's own (non-zero) choice
                    out.append(("no_prefetch", {"zero_optimization": {"stage3_prefetch_bucket_size": 0}}))
                threshold = _number(zero.get("stage3_param_persistence_threshold", DS_PERSISTENCE))
                if threshold:
                    persist = int(threshold * 100)
                    out.append(("persistence_x100", {"zero_optimization": {"stage3_param_persistence_threshold": persist}}))
                return out
            return []
        options = yaml.safe_load(source.read_text()) or {}
        # FSDP1's file has backward prefetch, FSDP2's not
        return get_backend(options.get("backend", fsdp_config.DEFAULT_BACKEND)).planner_variants(options)
    except (ConfigError, OSError, yaml.YAMLError, ValueError, TypeError, AttributeError):
        return []
    return []


def _number(value) -> float | None:
    """A DeepSpeed setting as a number; None for "auto" (DeepSpeed chooses) or anything else."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _source(config: str) -> Path:
    """A configuration file as named: from here, else from the repository (the shipped ones)."""
    return Path(config) if Path(config).is_file() else REPO / config


def write_variants(configs: list[str], directory: str) -> dict[str, str]:
    """Every variant of `configs` (variants()) written into `directory` as <file>.<variant>.<ext>:
    {its absolute path: the configuration it varies}; DDP's, set by flags, as {"NAME --flag value":
    NAME}. A file already there with other contents is refused, not rewritten; so are the shipped
    folders (the planner would list the variants as shipped configurations)."""
    writable_out("--variants", directory)
    target = Path(directory).resolve()
    if target in ((REPO / "ds_configs").resolve(), (REPO / "fsdp_configs").resolve()):
        raise ConfigError(f"--variants {directory}: the shipped configurations' folder; give another directory")
    written: dict[Path, tuple[str, str]] = {}
    flagged = {" ".join([config, *(f"--{k} {v:g}" for k, v in changes.items())]): config
               for config in configs if not config.endswith((".json", ".yaml")) for _, changes in variants(config)}
    for config in configs:
        if not config.endswith((".json", ".yaml")):
            continue
        source = _source(config)
        for name, changes in variants(config):
            if config.endswith(".json"):
                data = deepspeed_config.read(str(source))
                data["zero_optimization"] = {**data.get("zero_optimization", {}), **changes["zero_optimization"]}
                text = json.dumps(data, indent=2) + "\n"
            else:
                text = (f"# {config} with {name.replace('_', ' ')} (python -m analysis.plan --variants)\n"
                        + yaml.safe_dump({**(yaml.safe_load(source.read_text()) or {}), **changes}, sort_keys=False))
            path = target / f"{source.stem}.{name}{source.suffix}"
            if path in written and written[path] != (config, text):
                raise ConfigError(f"--variants: {written[path][0]} and {config} would both write {path.name}; "
                                  "compare them in two plans")
            try:
                other = path.exists() and path.read_text() != text
            except (OSError, ValueError):  # a directory, unreadable, not text
                other = True
            if other:
                raise ConfigError(f"--variants {directory}: {path.name} exists with other contents; the planner "
                                  "does not rewrite it (another directory, or remove it)")
            written[path] = (config, text)
    try:  # everything checked first: a refusal writes nothing
        target.mkdir(parents=True, exist_ok=True)
        for path, (_, text) in written.items():
            if not path.exists():
                path.write_text(text)
    except OSError as e:
        raise ConfigError(f"--variants {directory}: cannot write there ({e.strerror or e})") from None
    return {**{str(path): config for path, (config, _) in written.items()}, **flagged}


def candidates(configs: list[str], world: int, global_batch: int, ckpt: tuple[str, ...] = CKPT,
               micro_batches: list[int] | None = None, bases: dict[str, str] | None = None) -> list[Candidate]:
    """Every configuration x micro-batch x accumulation (micro x accumulation x world = global batch)
    x checkpointing."""
    if global_batch % world:
        raise ConfigError(f"global_batch {global_batch} must be a multiple of world {world} "
                          "(micro-batch x accumulation x world)")
    per_rank = global_batch // world
    micros = [m for m in range(1, per_rank + 1) if per_rank % m == 0 and (micro_batches is None or m in micro_batches)]
    if not micros:
        raise ConfigError(f"micro_batches {micro_batches}: none divides the {per_rank} samples per rank "
                          f"(global_batch {global_batch} / world {world})")
    return [Candidate(c, m, per_rank // m, k, (bases or {}).get(c)) for c in configs for m in micros for k in ckpt]
