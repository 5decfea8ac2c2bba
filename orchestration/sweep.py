"""Sweeps: a YAML matrix of runs, planned (orchestration/runner.py launches them).

A spec (sweeps/*.yaml) names a matrix over backend configurations, activation checkpointing,
micro-batch, precision, world size, preset, compilation and model, plus train.py flags common to every run. Each run
goes through its backend's real launcher (torchrun for torch backends, deepspeed's launcher for
DeepSpeed, plain python for `single`) on a free port, with a per-run timeout, and leaves its
record in the sweep's directory. A failed, out-of-memory or timed-out run is recorded with that
status and the sweep goes on; running the same spec again skips runs already done.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path

from backends import BACKEND_NAMES, DEEPSPEED, get_backend
from core.configfile import load_yaml
from gptlite.errors import ConfigError
from orchestration.launch import REPO, launch_command, launcher_for

# Flags the sweep sets itself for every run; a spec cannot set them in train_args.
SWEEP_OWNED = {"backend", "fsdp_config", "deepspeed_config", "runs_dir", "run_name", "overwrite", "quiet", "model",
               "model_args",
               "dry_run", "local_rank", "preset", "micro_batch", "precision", "ckpt_interval", "ckpt_impl", "steps",
               "ckpt_offload", "offload_activations", "activation_loading_horizon", "compile", "compile_backend",
               "ckpt_policy", "ckpt_plan", "ckpt_save_ops"}


# sbatch's long options for a job (Slurm 26.11's sbatch(1), and --power from earlier releases), as
# executor.sbatch names them (submitit writes each key as #SBATCH --key=value, '_' as '-'). Left out:
# sbatch's own switches (help, usage, version, test-only, wrap, parsable, wait, quiet, verbose), which
# are no job's settings and would change what submitit reads back from sbatch.
SBATCH_OPTIONS = (
    "account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir", "cluster-constraint", "clusters",
    "comment", "consolidate-segments", "constraint", "container", "container-id", "contiguous", "core-spec",
    "cores-per-socket", "cpu-freq", "cpus-per-gpu", "cpus-per-task", "deadline", "delay-boot", "dependency",
    "distribution", "error", "exclude", "exclusive", "export", "export-file", "extra", "extra-node-info",
    "get-user-env", "gid", "gpu-bind", "gpu-freq", "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres",
    "gres-flags", "hint", "ignore-pbs", "input", "job-name", "kill-on-invalid-dep", "licenses", "mail-type",
    "mail-user", "mcs-label", "mem", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mem-update", "mincpus", "network",
    "nice", "no-kill", "no-requeue", "nodefile", "nodelist", "nodes", "ntasks", "ntasks-per-core", "ntasks-per-gpu",
    "ntasks-per-node", "ntasks-per-socket", "oom-kill-step", "open-mode", "output", "overcommit", "oversubscribe",
    "partition", "power", "prefer", "priority", "profile", "propagate", "qos", "reboot", "requeue", "reservation",
    "resources", "resv-ports", "runtime", "segment", "signal", "sockets-per-node", "spread-job", "spread-segments",
    "stepmgr", "switches", "thread-spec", "threads-per-core", "time", "time-min", "tmp", "tres-bind", "tres-per-task",
    "uid", "use-min-nodes", "wait-all-nodes", "wckey")


def _non_empty(name: str, values: list) -> None:
    if not values:
        raise ConfigError(f"matrix.{name} must list at least one value")


@dataclass
class SlurmSettings:
    """The spec's `executor:` section (sweep.py's flags of the same names override it)."""

    partition: str | None = None  # default: the cluster's default partition
    account: str | None = None
    time_min: int = 60  # each job's time limit, minutes
    nodes: int = 1  # nodes per run: torchrun on each, its c10d rendezvous on the job's first host
    gpus_per_node: int = 0  # 0: CPU ranks; else one rank per GPU, at most this many on a node
    cpus_per_task: int | None = None  # CPUs for a node's ranks; default: one per rank
    array_parallelism: int = 64  # jobs of one array running at once
    signal_delay_s: int = 120  # SIGUSR2 this long before the time limit: the run stops, or checkpoints and requeues
    max_requeues: int = 3  # how many times a run with checkpoints is requeued after its time limit
    sbatch: dict = field(default_factory=dict)  # more sbatch options, e.g. {qos: high, constraint: a100}
    setup: list[str] = field(default_factory=list)  # shell lines before each run, e.g. ["module load cuda"]

    def __post_init__(self):
        for name in ("time_min", "nodes", "array_parallelism", "signal_delay_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"executor.{name} must be an integer >= 1 (got {value!r})")
        for name in ("gpus_per_node", "max_requeues"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"executor.{name} must be an integer >= 0 (got {value!r})")
        if self.cpus_per_task is not None and (not isinstance(self.cpus_per_task, int) or self.cpus_per_task < 1):
            raise ConfigError(f"executor.cpus_per_task must be an integer >= 1 (got {self.cpus_per_task!r})")
        if self.time_min * 60 <= self.signal_delay_s + 30:
            raise ConfigError(f"executor.time_min {self.time_min} cannot hold a run: the job is signalled to stop "
                              f"executor.signal_delay_s ({self.signal_delay_s} s) before its limit, and a run needs "
                              f"30 s to start; give time_min > {(self.signal_delay_s + 30) // 60} or a shorter "
                              "signal_delay_s")
        for name in ("sbatch", "setup"):
            kind = dict if name == "sbatch" else list
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"executor.{name} must be a {'mapping' if kind is dict else 'list'}")
        reserved = {"time", "nodes", "partition", "account", "cpus-per-task", "cpus_per_task", "array", "signal",
                    "output", "error", "ntasks-per-node", "gpus-per-node"} & set(self.sbatch)
        if reserved:
            raise ConfigError(f"executor.sbatch: '{sorted(reserved)[0]}' is set by the sweep (executor's own keys); "
                              "set it there")
        # Checked here, not only by `sbatch --test-only` at submission: a spec run locally first would
        # otherwise carry a misspelt option until the day it goes to the cluster.
        for key in self.sbatch:
            if str(key).replace("_", "-") not in SBATCH_OPTIONS:
                close = difflib.get_close_matches(str(key).replace("_", "-"), SBATCH_OPTIONS, n=1, cutoff=0.75)
                hint = f"did you mean '{close[0]}'?" if close else "see man sbatch, e.g. qos, constraint, mem, gres"
                raise ConfigError(f"executor.sbatch: '{key}' is not an sbatch option for a job ({hint})")


@dataclass
class Matrix:
    # a backend's name (backends/registry.py), or a config file: fsdp_configs/*.yaml, ds_configs/*.json
    backend: list[str]
    ckpt_interval: list[int] = field(default_factory=lambda: [0])
    ckpt_impl: list[str] = field(default_factory=lambda: ["torch_nonreentrant"])
    micro_batch: list[int] = field(default_factory=lambda: [8])
    precision: list[str] = field(default_factory=lambda: ["fp32"])
    world_size: list[int] = field(default_factory=lambda: [2])
    preset: list[str] = field(default_factory=lambda: ["tiny"])
    # What happens to the checkpointed blocks' saved inputs: "none" (kept in place), "torch"
    # (--ckpt_offload: torch's offload, fetched on demand) or "prefetch<H>" (--offload_activations
    # with --activation_loading_horizon H). Only with ckpt_interval > 0.
    activation_offload: list[str] = field(default_factory=lambda: ["none"])
    # "none" (eager) or a torch.compile backend (--compile --compile_backend): inductor, aot_eager, eager.
    compile: list[str] = field(default_factory=lambda: ["none"])
    # What a checkpointed block keeps (--ckpt_policy): "full" or "selective" for the blocks ckpt_interval
    # picks (only with ckpt_interval > 0), or "auto:<GiB>": --ckpt_policy auto --mem_budget_gb <GiB>, a
    # plan per block for that budget (with ckpt_interval 0 only: it chooses every block itself).
    ckpt_policy: list[str] = field(default_factory=lambda: ["full"])
    # The model (--model): "gptlite", "hf:<type>", "torchvision:<name>", a model file; or a mapping
    # {model: hf:llama, args: {hidden_size: 64, ...} (or "k=v,..."), label: llama_small} with its
    # --model_args and the name it takes in run names (default: hf_llama). The presets size GPT-lite
    # (and give hf: text models their context length); other models run with the first preset.
    # GPT-lite's args are its own flags over each preset ({model: gptlite, args: {n_layer: 2},
    # label: shallow}: runs named shallow.tiny, ...; plain GPT-lite's are named tiny, ...).
    model: list = field(default_factory=lambda: ["gptlite"])

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _non_empty(f.name, getattr(self, f.name))
            values = getattr(self, f.name)
            # a value listed twice is the same runs twice: expand() would keep one, saying nothing
            # (two model entries: by their labels, below)
            twice = next((v for i, v in enumerate(values) if v in values[:i]), None) if f.name != "model" else None
            if twice is not None:
                raise ConfigError(f"matrix.{f.name}: each value at most once ({twice!r} is listed "
                                  f"{values.count(twice)} times)")
        for value in self.activation_offload:
            offload_flags(value)
        for value in self.ckpt_policy:
            policy_flags(value)
        labels = [model_entry(entry).label for entry in self.model]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"matrix.model: two entries have the same label ({', '.join(labels)}); give each a label")
        labels = {}
        for entry in self.backend:  # its label names the runs: two entries of one label would be one run
            label = backend_of(entry)[2]
            if label in labels:
                raise ConfigError(f"matrix.backend: '{labels[label]}' and '{entry}' would both name their runs "
                                  f"{label}-...; list a configuration once, or give the file another name")
            labels[label] = entry
        # torch, imported here and not at the top: a Slurm job's wrapper unpickles its SweepRun, importing
        # this module, and holds no torch while its run trains.
        from core.config import CKPT_IMPLS, COMPILE_BACKENDS, PRECISIONS
        from gptlite.model import PRESETS

        for name, allowed in (("precision", PRECISIONS), ("preset", tuple(PRESETS)),
                              ("compile", ("none", *COMPILE_BACKENDS)), ("ckpt_impl", CKPT_IMPLS)):
            for value in getattr(self, name):
                if value not in allowed:
                    raise ConfigError(f"matrix.{name} values must be among {', '.join(allowed)} (got {value!r})")
        for name in ("ckpt_interval", "micro_batch", "world_size"):
            minimum = 0 if name == "ckpt_interval" else 1
            for value in getattr(self, name):
                if value < minimum:
                    raise ConfigError(f"matrix.{name} values must be >= {minimum} (got {value})")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    args: str | None
    label: str


# What a GPT-lite entry's args may set: its train.py model flags (the preset gives the rest).
GPTLITE_ARGS = ("n_layer", "n_embd", "n_head", "block_size", "dropout", "attention")
# The train.py flags that decide a run's model and data (what training/run.py check_model reads).
MODEL_FLAGS = ("model", "model_name_or_path", "model_args", "preset", *GPTLITE_ARGS, "data", "block_class")


def model_entry(entry) -> ModelEntry:
    """A matrix.model entry, checked: a --model value, or {model, args, label}."""
    from models.spec import check_name, format_model_args, model_label, parse_model_args  # torch: see Matrix

    if isinstance(entry, str):
        entry = {"model": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("model"), str) or set(entry) - {"model", "args", "label"}:
        raise ConfigError(f"matrix.model entries must be a --model value or a mapping with model, args and label "
                          f"(got {entry!r})")
    check_name(entry["model"])
    args = entry.get("args")
    if isinstance(args, dict):
        args = format_model_args(args)
    elif args is not None and not isinstance(args, str):
        raise ConfigError(f"matrix.model: args of {entry['model']} must be a mapping or a k=v,... string")
    parsed = parse_model_args(args)
    if entry["model"] == "gptlite" and set(parsed) - set(GPTLITE_ARGS):
        unknown = ", ".join(sorted(set(parsed) - set(GPTLITE_ARGS)))
        raise ConfigError(f"matrix.model: gptlite's args are train.py's GPT-lite flags ({', '.join(GPTLITE_ARGS)}); "
                          f"it has no {unknown}")
    label = entry.get("label") or model_label(entry["model"])
    if not isinstance(label, str) or not label.replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"matrix.model: label must be letters, digits, '_' and '.' (got {label!r})")
    return ModelEntry(entry["model"], args or None, label)


def model_flags(model: ModelEntry) -> dict:
    """The train.py flags of a matrix.model entry: --model and --model_args, or for GPT-lite its
    args as its own flags (--n_layer 2): applied, never dropped."""
    from models.spec import parse_model_args  # torch: see Matrix.__post_init__

    if model.name == "gptlite":
        return parse_model_args(model.args)
    return {"model": model.name, "model_args": model.args}


def policy_flags(value) -> dict:
    """train.py flags of a matrix.ckpt_policy value: full, selective or auto:<GiB>."""
    if value in ("full", "selective"):
        return {"ckpt_policy": value}
    budget = str(value).removeprefix("auto:")
    try:
        if str(value).startswith("auto:") and float(budget) > 0:
            return {"ckpt_policy": "auto", "mem_budget_gb": float(budget)}
    except ValueError:
        pass
    raise ConfigError(f"matrix.ckpt_policy values must be full, selective or auto:<GiB> such as auto:0.5 "
                      f"(got {value!r})")


def offload_flags(value: str) -> dict:
    """train.py flags of a matrix.activation_offload value."""
    if value == "none":
        return {}
    if value == "torch":
        return {"ckpt_offload": True}
    horizon = value.removeprefix("prefetch")
    if value.startswith("prefetch") and horizon.isdigit():
        return {"offload_activations": True, "activation_loading_horizon": int(horizon)}
    raise ConfigError(f"matrix.activation_offload values must be none, torch or prefetch<H> such as prefetch2 "
                      f"(got {value!r})")


@dataclass
class SweepSpec:
    name: str
    matrix: Matrix
    steps: int = 20
    timeout_s: float = 900.0
    runs_dir: str | None = None  # default: runs/sweeps/<name>
    train_args: dict = field(default_factory=dict)  # train.py flags for every run, e.g. {dropout: 0.0}
    env: dict = field(default_factory=dict)  # environment variables for every run
    # How runs are submitted with sweep.py --executor slurm (orchestration/slurm.py); unused locally.
    executor: SlurmSettings = field(default_factory=SlurmSettings)

    def __post_init__(self):
        from core.config import RunConfig, check_plain_name  # torch: see Matrix.__post_init__

        check_plain_name("name", self.name)  # its folder, runs/sweeps/<name>
        if self.steps < 1 or self.timeout_s <= 0:
            raise ConfigError("steps must be >= 1 and timeout_s > 0")

        known = {f.name for f in dataclasses.fields(RunConfig)}
        for key in self.train_args:
            if key not in known:
                raise ConfigError(f"train_args: unknown train.py flag '{key}'")
            if key in SWEEP_OWNED:
                raise ConfigError(f"train_args: '{key}' is set by the sweep (the matrix or the spec's own keys)")
            if key in ("save_dir", "resume"):
                raise ConfigError(f"train_args: '{key}' is set by the sweep: with save_every each run checkpoints into "
                                  "<runs dir>/.ckpt/<run> and continues from there when run again (or requeued)")
        if "mem_budget_gb" in self.train_args and any(str(p).startswith("auto:") for p in self.matrix.ckpt_policy):
            raise ConfigError("train_args: 'mem_budget_gb' is also set by matrix.ckpt_policy's auto:<GiB>; set it in "
                              "one place")
        for model in map(model_entry, self.matrix.model):  # a setting in two places: one would be unused
            both = sorted(set(model_flags(model)) & set(self.train_args))
            if both:
                raise ConfigError(f"train_args: '{both[0]}' is also in matrix.model's args of {model.label}; "
                                  "set it in one place")

    @property
    def directory(self) -> Path:
        return Path(self.runs_dir) if self.runs_dir else REPO / "runs" / "sweeps" / self.name


def load_spec(path: str) -> SweepSpec:
    return load_yaml(path, SweepSpec, flag="sweep spec")


def backend_of(entry: str) -> tuple[str, str | None, str]:
    """(backend name, config file or None, short label) of a matrix.backend entry."""
    if entry in BACKEND_NAMES:
        if get_backend(entry).needs_config_file:
            raise ConfigError(f"matrix.backend: {entry} needs a config file ({get_backend(entry).config_files})")
        return entry, None, entry
    path = Path(entry) if Path(entry).is_absolute() else REPO / entry
    if not path.is_file():
        raise ConfigError(f"matrix.backend: '{entry}' is neither a backend ({', '.join(BACKEND_NAMES)}) nor an existing "
                          "config file")
    if path.suffix == ".json":  # DeepSpeed's
        return DEEPSPEED, entry, f"{DEEPSPEED}.{path.stem}"
    if path.suffix in (".yaml", ".yml"):
        from backends import fsdp_config  # torch: see Matrix.__post_init__

        backend = fsdp_config.load(str(path)).backend
        return backend, entry, f"{backend}.{path.stem}"
    raise ConfigError(f"matrix.backend: '{entry}' must be a .json (DeepSpeed) or .yaml (FSDP) file")


@dataclass(frozen=True)
class SweepRun:
    name: str
    backend: str
    config_file: str | None
    world_size: int
    flags: tuple[tuple[str, object], ...]  # train.py flags, in order
    env: tuple[tuple[str, str], ...] = ()
    # The run's coordinates in the matrix (label, ckpt, world, preset, precision), micro-batch left
    # out: the runs of one configuration share it (the largest-batch search groups by it).
    config_key: str = ""

    @property
    def resumable(self) -> bool:
        """It checkpoints (save_every) and continues from its last checkpoint when started again."""
        return bool(dict(self.flags).get("resume"))

    def argv(self, runs_dir: Path) -> list[str]:
        # Never --overwrite: the runner replaces a record itself, under its lock (orchestration/runner.py).
        args = ["--runs_dir", str(runs_dir), "--run_name", self.name, "--quiet"]
        if self.config_file:
            args += [f"--{get_backend(self.backend).config_flag}", self.config_file]
        else:
            args += ["--backend", self.backend]
        for key, value in self.flags:
            if value is True:
                args.append(f"--{key}")
            elif value is not False and value is not None:
                args += [f"--{key}", str(value)]
        return args

    def command(self, runs_dir: Path) -> list[str]:
        """The launch command, as a user would type it (with a free port)."""
        return [*launch_command(launcher_for(self.backend), self.world_size), *self.argv(runs_dir)]

    def key(self) -> dict:
        """Everything about the run that changes its result, so a record is reused only for the same
        run: flags, launcher, world size, environment, and the contents of the files it reads (the
        backend's config file, --data, a --model file). The suite's own code is not in it: a sweep reruns nothing
        when the code changes; give it another name for that."""
        # Without --runs_dir, --run_name and --quiet; and without --tracker, which changes where the run
        # is also logged, not what it records: a sweep given a tracker later reuses its records.
        untracked = dataclasses.replace(self, flags=tuple((k, v) for k, v in self.flags if k != "tracker"))
        flags = [f for f in untracked.argv(Path("."))[4:] if f != "--quiet"]
        data, model = dict(self.flags).get("data"), dict(self.flags).get("model")
        model_file = Path(model) if model and model.endswith(".py") else None
        return {"backend": self.backend, "world_size": self.world_size, "launcher": launcher_for(self.backend),
                "flags": flags, "env": dict(self.env),
                "config_file_sha256": _sha256(REPO / self.config_file) if self.config_file else None,
                "data_sha256": _sha256(Path(data)) if data else None,
                **({"model_file_sha256": _sha256(model_file if model_file.is_absolute() else REPO / model_file)}
                   if model_file else {})}

    def with_flags(self, name: str, **flags) -> "SweepRun":
        merged = dict(self.flags)
        merged.update(flags)
        return dataclasses.replace(self, name=name, flags=tuple(merged.items()))


def expand(spec: SweepSpec) -> tuple[list[SweepRun], list[str]]:
    """The runs of the matrix, and the combinations left out (with why)."""
    m = spec.matrix
    runs: dict[str, SweepRun] = {}
    skipped: list[str] = []
    for entry, interval, impl, offload, micro, precision, world, preset, compiled, model, policy in itertools.product(
            m.backend, m.ckpt_interval, m.ckpt_impl, m.activation_offload, m.micro_batch, m.precision, m.world_size,
            m.preset, m.compile, [model_entry(e) for e in m.model], m.ckpt_policy):
        backend, config_file, label = backend_of(entry)
        gptlite = model.name == "gptlite"
        if not gptlite and preset != m.preset[0]:
            continue  # the presets size GPT-lite; another model runs once, with the first
        ranks = world
        one_process = get_backend(backend).one_process
        if one_process:
            world = 1  # one process by definition
        # The one process (`single`) stands in for the matrix's `ranks` ranks: it accumulates over them, so that it
        # trains on the same global batch, and so the same samples step by step (gptlite/data.py), as the runs it
        # is compared to.
        accum = int(spec.train_args.get("grad_accum", 1)) * (ranks if one_process else 1)
        stands_in = one_process and ranks > 1
        auto = str(policy).startswith("auto:")
        if auto and (interval or impl != m.ckpt_impl[0] or offload != m.activation_offload[0]):
            continue  # auto chooses every block itself (ckpt_interval 0), and takes no impl or offload: once
        if not interval and policy == "selective":
            continue  # nothing checkpointed: the same run as full's
        if not interval:
            impl, offload = "none", "none"  # nothing checkpointed (or a plan): nothing to offload
            policy = policy if auto else "full"
        elif impl not in get_backend(backend).ckpt_impls and (owner := _ckpt_impl_owner(impl)):
            skipped.append(f"{label} with ckpt_impl {impl}: needs the {owner} backend")
            continue
        if policy == "selective" and (impl != "torch_nonreentrant" or offload != "none") or \
                policy != "full" and compiled != "none":
            skipped.append(f"{label} with ckpt_policy {policy}: needs ckpt_impl torch_nonreentrant, without offload "
                           "or compile")
            continue
        if policy == "selective" and get_backend(backend).refuses_selective_checkpointing(
                str(REPO / config_file) if config_file else None):
            skipped.append(f"{label} with ckpt_policy selective: refused under ZeRO-3 (wrong gradients)")
            continue
        ckpt = f"ckpt{interval}-{impl}" if interval else "ckpt0"
        if policy == "selective":
            ckpt += "-selective"
        elif auto:
            ckpt = f"auto{float(policy.removeprefix('auto:')):g}"
        if offload != "none":
            ckpt += f"-offload_{offload}"
        if compiled != "none":
            ckpt += f"-compile_{compiled}"
        if gptlite:  # plain GPT-lite is named by its preset; with args or a label of its own, by both
            size = preset if (model.label, model.args) == ("gptlite", None) else f"{model.label}.{preset}"
        else:
            size = model.label
        batch = f"mb{micro}x{accum}" if stands_in else f"mb{micro}"
        key = f"{label}-w{world}-{size}-{precision}-{ckpt}" + (f"-accum{accum}" if stands_in else "")
        name = f"{label}-w{world}-{size}-{batch}-{precision}-{ckpt}"
        flags = {**model_flags(model), "preset": preset, "micro_batch": micro, "precision": precision,
                 "steps": spec.steps, "ckpt_interval": interval, **({"ckpt_impl": impl} if interval else {}),
                 **(policy_flags(policy) if policy != "full" else {}),
                 **offload_flags(offload),
                 **({"compile": True, "compile_backend": compiled} if compiled != "none" else {}), **spec.train_args,
                 **({"grad_accum": accum} if stands_in else {})}
        swap_flag = get_backend(backend).swap_flag
        if config_file and swap_flag and get_backend(backend).swaps(str(REPO / config_file)):
            flags.setdefault(swap_flag, str(spec.directory / ".nvme" / name))
        if spec.train_args.get("save_every"):  # its own checkpoints, continued when the run starts again
            flags.update(save_dir=str(spec.directory / ".ckpt" / name), resume=True)
        runs.setdefault(name, SweepRun(name, backend, config_file, world, tuple(flags.items()),
                                         tuple((k, str(v)) for k, v in spec.env.items()), key))
    return list(runs.values()), list(dict.fromkeys(skipped))


def _ckpt_impl_owner(impl: str) -> str | None:
    """The backend that alone runs --ckpt_impl `impl` (Backend.ckpt_impls), or None: every backend runs it."""
    return next((name for name in BACKEND_NAMES if impl in get_backend(name).ckpt_impls), None)


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
