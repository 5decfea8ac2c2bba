"""Plan a run: which configuration to train a model with on W ranks under a memory budget per rank.

    python -m analysis.plan --world 2 --gpu here --mem_budget_gb 0.3 --global_batch 16 --preset small
    python -m analysis.plan --world 8 --gpu H100-SXM --mem_budget_gb 40 --global_batch 64 \\
        --preset paper --precision bf16 --attention sdpa

The model is train.py's flags (any model that trains: GPT-lite, hf:, a model file; train.py's names
and defaults). The planner chooses the rest: the backend configuration (ddp and every shipped
fsdp_configs/ and ds_configs/ file, or --configs), micro-batch x accumulation with micro x accumulation
x W = --global_batch, and checkpointing (none, full every k, selective every k: --ckpt). Each candidate
is resolved as train.py resolves it (training/describe.py: a refused one is listed with train.py's
reason), its peak per rank estimated (analysis.estimate; over the budget less the estimator's error
band, MARGIN, 15%: dropped, naming the part that breaks it), and its step timed by a
model whose parts are printed:

    compute   --gpu NAME: FLOPs per sample (counted, plus what checkpointing recomputes) x samples per
              rank / (the precision's peak x MFU), as analysis.project;
              --gpu here: calibrated on this machine's device: the model's forward and backward timed
              at two micro-batches (a fixed time per micro-step plus a time per sample), the optimizer
              step timed, and the recompute of full and selective checkpointing timed as a share of a
              micro-step's time
    comm      each backend's collectives by theory (Backend.comm_theory) over alpha-beta links
              (hardware.yaml for a named GPU; --gpu here: all_reduce timed between W local processes),
              cut into the calls the configuration's bucket sizes make (Backend.comm_schedule: each
              call pays the link's latency); with --counted, the calls and bytes counted by running
              the candidate as rank 0 of W under the fake process group (training.fake_world)
    wait      the share of comm nothing overlaps (Backend.comm_schedule): DeepSpeed stage 0's all-reduce
              after backward, ZeRO-1/2's gather in the optimizer step and reductions without
              overlap_comm, ZeRO-3's gathers with stage3_prefetch_bucket_size 0, FSDP's backward
              gathers with backward_prefetch null, DDP's last bucket (ready when backward ends); on
              the critical path, never hidden
    offload   host<->device bytes / PCIe and the CPU optimizer's time (a named GPU only)
    step      compute + (1 - overlap) x comm + wait + offload;  samples/s = global batch / step

--variants DIR adds the variants of the compared configurations that change speed or memory (bucket
sizes, prefetching: variants()), written into DIR as the files their commands name (DDP's are flags).
The answer is ranked by predicted samples/s, with each candidate's exact launch command.
--verify K runs the top K and two further down (here, or as Slurm jobs with --executor slurm;
--verify_rounds R runs each R times, taking turns), refits the step model on them and picks the
fastest measured. --out DIR writes plan.md and plan.png (every
candidate's estimated peak against its predicted samples/s, with the frontier and the budget).
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import functools
import gc
import json
import math
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from gptlite.data import DataError
from gptlite.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
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
CHOSEN_FLAGS = ("backend", "fsdp_config", "deepspeed_config", "deepspeed", "accelerate_plugin", "micro_batch",
                "grad_accum", "ckpt_interval", "ckpt_policy", "ckpt_plan", "mem_budget_gb", "ddp_bucket_cap_mb")
# train.py flags of one run, not of the model: copied into every candidate's command, each would
# name the same record or checkpoint directory.
RUN_OWN_FLAGS = ("run_name", "save_dir", "resume")


def _check_config(config: str) -> None:
    """--configs: a backend's name, an FSDP/FSDP2 YAML file (fsdp_configs/) or a DeepSpeed JSON file
    (ds_configs/), read as train.py reads it: an accelerate config or any other YAML is refused here."""
    if config in ("single", "ddp", "fsdp", "fsdp2"):
        return
    allowed = "single, ddp, fsdp, fsdp2, or an fsdp_configs/*.yaml or ds_configs/*.json file (relative to the repository)"
    if not (config.endswith((".yaml", ".json")) and (REPO / config).is_file()):
        raise ConfigError(f"--configs {config}: must be {allowed}")
    if config.endswith(".yaml"):
        from backends import fsdp_config

        try:
            fsdp_config.load(str(REPO / config))
        except ConfigError as e:
            raise ConfigError(f"--configs {config}: not an FSDP configuration ({e}); must be {allowed}") from None
    else:
        from backends import deepspeed_config

        deepspeed_config.validate(config, deepspeed_config.read(str(REPO / config)))


def _check_ckpt_within_blocks(ckpt: tuple[str, ...], given) -> None:
    """--ckpt full/K or selective/K: K at most the model's blocks (every K-th block from the first:
    a K beyond them checkpoints block 0 alone, what K = the blocks already says)."""
    import models
    from core.blocks import find_blocks

    n = len(find_blocks(models.load(given.model_request()).meta(), given.block_class))
    for c in ckpt:
        if c != "none" and int(c.split("/")[1]) > n:
            raise ConfigError(f"--ckpt {c}: K must be at most the model's {n} blocks (every K-th block from the first)")


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
        policy, _, k = self.ckpt.partition("/")
        if self.ckpt != "none" and (policy not in ("full", "selective") or not k.isdigit() or int(k) < 1):
            raise ConfigError(f"ckpt {self.ckpt!r}: must be none, full/K or selective/K (K >= 1)")

    def flags(self) -> list[str]:
        """train.py's flags for this candidate (besides the model's)."""
        from analysis.project import config_flags

        entry, options = self.parts
        flags = [*config_flags(entry), *options, "--micro_batch", str(self.micro_batch),
                 "--grad_accum", str(self.grad_accum)]
        if self.ckpt != "none":
            policy, k = self.ckpt.split("/")
            flags += ["--ckpt_interval", k] + (["--ckpt_policy", "selective"] if policy == "selective" else [])
        return flags

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
    from analysis.project import configurations as shipped

    if world == 1:
        return ["single"]
    return [c for c in shipped() if not ("hybrid" in c and world <= per_node)]


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
    if config == "ddp":
        from backends.ddp import DEFAULT_BUCKET_MIB

        return [(f"buckets_{name}", {"ddp_bucket_cap_mb": DEFAULT_BUCKET_MIB * f}) for name, f in (("quarter", 0.25),
                                                                                                 ("x4", 4))]
    if not config.endswith((".json", ".yaml")):
        return []
    source = _source(config)
    try:
        if config.endswith(".json"):
            from backends.deepspeed_config import read

            zero = read(str(source)).get("zero_optimization") or {}
            if zero.get("stage", 0) in (1, 2):
                size = int(float(zero.get("reduce_bucket_size", 5e8)))
                return [(f"buckets_{name}", {"zero_optimization": {"reduce_bucket_size": max(2, int(size * f) // 2 * 2)}})
                        for name, f in (("quarter", 0.25), ("x4", 4))]
            if zero.get("stage") == 3:
                from estimator.memory_model import DS_PERSISTENCE

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
        if options.get("backend", "fsdp") == "fsdp" and options.get("sharding_strategy", "FULL_SHARD") in (
                "FULL_SHARD", "HYBRID_SHARD") and options.get("backward_prefetch", "BACKWARD_PRE") is not None:
            return [("no_backward_prefetch", {"backward_prefetch": None})]
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
    {its absolute path: the configuration it varies}; DDP's, set by flags, as {"ddp --flag value":
    "ddp"}. A file already there with other contents is refused, not rewritten; so are the shipped
    folders (the planner would list the variants as shipped configurations)."""
    from training.preflight import writable_out

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
                from backends.deepspeed_config import read

                data = read(str(source))
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


@dataclass
class Link:
    """An alpha-beta link: bus GB/s and latency (microseconds) per ring step; where it came from."""

    gb_s: float
    latency_us: float
    source: str


@dataclass
class Device:
    """What the step-time model knows of the device: a named GPU's datasheet, or this machine measured."""

    name: str
    inside: Link  # between the ranks of a node
    between: Link  # between nodes
    flops_per_s: float | None = None  # peak x MFU (a named GPU)
    micro_step_s: float = 0.0  # calibrated: fixed seconds per micro-step
    sample_s: float = 0.0  # calibrated: seconds per sample of forward and backward
    optimizer_s: float = 0.0  # calibrated: the optimizer step
    recompute: dict = dataclasses.field(default_factory=dict)  # calibrated: {full, selective}: extra share
    pcie_gb_s: float | None = None
    cpu_adam_gparams_s: float = 1.0
    overlap: float = 0.5
    memory_gib: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def named_device(name: str, network: str, mfu: float, overlap: float, precision: str) -> Device:
    """A GPU of analysis/hardware.yaml: its datasheet peak for `precision` x MFU and its links."""
    from analysis.project import HARDWARE

    hw = yaml.safe_load(HARDWARE.read_text())
    gpu, net = hw["gpus"][name], hw["networks"][network]
    peak = gpu["fp32_tflops" if precision == "fp32" else "bf16_tflops"] * 1e12
    return Device(name, Link(gpu["nvlink_gb_s"], hw["nvlink_latency_us"], "datasheet (hardware.yaml)"),
                  Link(net["gb_s_per_gpu"], net["latency_us"], f"{network} (hardware.yaml)"), flops_per_s=peak * mfu,
                  pcie_gb_s=gpu["pcie_gb_s"], overlap=overlap, memory_gib=gpu["memory_gib"],
                  notes=[f"compute: {precision} peak {peak / 1e12:g} TFLOP/s x MFU {mfu}", f"overlap {overlap}"])


def calibrate(workload, block_class: str | None, micro_batches: tuple[int, int], device: str, save_ops,
              reps: int = 3, precision: str = "fp32") -> dict:
    """This machine's device, measured on the real model (seed 0) in the run's `precision`: a
    micro-step's forward and backward at two micro-batches (each shape's first call untimed, a GPU
    warmed up on the larger, then the two taking turns, the median of `reps` each) fitted as fixed +
    per-sample seconds; the optimizer's step (AdamW); and what full and selective checkpointing
    of every block add, as a share of the larger micro-batch's time (ckpt_plan.measured_costs)."""
    import torch

    from estimator.ckpt_plan import forward_backward, measured_costs, seconds_of

    dev = torch.device(device)
    model = workload.build(0).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = {m: tuple(t.to(dev) for t in workload.example(m)) for m in micro_batches}

    def timed(m: int) -> float:
        return seconds_of(dev, lambda: forward_backward(model, *batches[m], precision))

    times: dict[int, list[float]] = {m: [] for m in micro_batches}
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for m in micro_batches:  # each shape's first call (kernel choice, allocation) is not timed
            timed(m)
        # The first micro-batch timed on a GPU read slow: on an H100, micro-batch 8 at 59.3 ms where the
        # grid's own runs say 43 (8x8 against 32x2, runs/reference/nvidia-h100-80gb-hbm3-plan), which
        # put 26 ms on every micro-step where they say 6.5; on an H200, micro-batch 1 timed first, 19 against
        # 6.5. So a GPU runs the largest for WARM_S first (a GPU from idle raises its clocks under load;
        # the cause is not established), and the points take turns, each rep timing both.
        started = time.perf_counter()
        while dev.type == "cuda" and time.perf_counter() - started < WARM_S:
            timed(max(micro_batches))
        for _ in range(reps):
            for m in micro_batches:
                times[m].append(timed(m))
    seconds = {m: statistics.median(t) for m, t in times.items()}
    step = statistics.median([seconds_of(dev, optimizer.step) for _ in range(reps + 1)][1:])
    small, large = micro_batches
    per_sample = max(0.0, (seconds[large] - seconds[small]) / (large - small))
    fixed = max(0.0, seconds[small] - small * per_sample)
    extra = measured_costs(workload, block_class, large, device, save_ops, ["full", "selective"], 0,
                           precision=precision) or {}
    return {"micro_step_s": fixed, "sample_s": per_sample, "optimizer_s": step,
            "recompute": {k: v / seconds[large] for k, v in extra.items()}, "timed": seconds}


def calibration_line(c: dict) -> str:
    """The calibrated line as a plan prints it (its assumptions; replay reads it back from a plan
    saved before --json carried `calibration`)."""
    return (f"{c['micro_step_s'] * 1e3:.1f} ms per micro-step + {c['sample_s'] * 1e3:.2f} ms per sample, "
            f"optimizer step {c['optimizer_s'] * 1e3:.1f} ms")


CALIBRATION_LINE = re.compile(r"([\d.]+) ms per micro-step \+ ([\d.]+) ms per sample, optimizer step ([\d.]+) ms")


def calibration_points(micro_batches: list[int], gpu: bool) -> tuple[int, int]:
    """The two micro-batches the calibration times to fit its fixed + per-sample line: the smallest
    and largest compared (from micro-batch 1, the calibration put 19 ms on each micro-step on an H200
    where the candidates' own 8 and 32 say 6.5: runs/reference/nvidia-h200/README.md; from 8, 26 ms on
    an H100, so the first point timed, not micro-batch 1, read slow: see calibrate); on a
    CPU, the smallest but at most an eighth of the largest. The fixed part is the line's intercept,
    2 t(4) - t(8) between 4 and 8, twice the noise of t(4): on this machine (GPT-lite small,
    2026-11-26) it read 238 ms per micro-step where 1 and 8 read none, and the planner ranked every
    8 x 1 candidate above 4 x 2 (benchmarks/plan_regret.py: regret 32%). A CPU's step has no launch
    overhead to speak of; a GPU's repeats within about 1%."""
    large, small = max(micro_batches), min(micro_batches)
    if not gpu:
        small = max(1, min(small, large // 8))
    return (small, large) if small < large else (small, 2 * small)


def probe_link(world: int, sizes: tuple[int, int] = (1024, 8 * 2**20), reps: int = 5) -> Link:
    """all_reduce timed between `world` local processes (gloo, this machine): a small message gives
    the latency per ring step, a large one the bus bandwidth."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_probe_rank, args=(r, world, f"{tmp}/store", sizes, reps, queue))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
        if any(proc.exitcode != 0 for proc in procs):
            raise RuntimeError("the all_reduce probe between local processes failed")
        small_s, large_s = queue.get()
    steps = 2 * (world - 1)
    bus = 2 * (world - 1) / world * sizes[1]
    return Link(bus / max(large_s - small_s, 1e-9) / 1e9, small_s / steps * 1e6,
                f"all_reduce timed between {world} local processes (gloo)")


def _probe_rank(rank: int, world: int, store: str, sizes, reps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    times = []
    for size in sizes:
        t = torch.zeros(size // 4)
        dist.all_reduce(t)  # warm-up
        dist.barrier()
        started = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        times.append((time.perf_counter() - started) / reps)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def here_device(train_argv: list[str], world: int, per_node: int, overlap: float,
                micro_batches: list[int]) -> Device:
    """This machine: compute calibrated on its device (at calibration_points of the `micro_batches`
    compared) with the CPU threads one of `per_node` ranks gets (core/dist.set_cpu_threads), its
    ranks' link probed."""
    import torch

    from core.dist import set_cpu_threads
    from training.describe import resolve_flags, simulated_env

    setup = resolve_flags([*train_argv, "--backend", "single"], 1)
    cfg = setup.cfg
    threads = torch.get_num_threads()
    set_cpu_threads(simulated_env(min(world, per_node), None, cfg.device))
    try:
        points = calibration_points(micro_batches, torch.device(setup.env.device).type == "cuda")
        c = calibrate(setup.workload, cfg.block_class, points, str(setup.env.device), cfg.save_ops(),
                      precision=cfg.precision)
    finally:
        torch.set_num_threads(threads)
        # The verifying runs are other processes on the same GPU: what the calibration's caching allocator
        # keeps (46 GiB for the paper preset at micro-batch 64 on an H100) is missing from theirs, and put
        # out of memory a candidate the budget admits (2026-11-26, runs/reference/nvidia-h100-80gb-hbm3-plan/).
        if torch.cuda.is_initialized():
            gc.collect()
            torch.cuda.empty_cache()
    inside = probe_link(world) if world > 1 else Link(math.inf, 0.0, "one rank: nothing to communicate")
    timed = ", ".join(f"micro-batch {m}: {s * 1e3:.1f} ms" for m, s in c["timed"].items())
    return Device(f"here ({setup.env.device})", inside, inside, micro_step_s=c["micro_step_s"],
                  sample_s=c["sample_s"], optimizer_s=c["optimizer_s"], recompute=c["recompute"], overlap=overlap,
                  notes=[f"compute calibrated on {setup.env.device}: forward and backward {timed}; "
                         f"{calibration_line(c)}; recompute of every block: "
                         + ", ".join(f"{k} +{v:.0%}" for k, v in c["recompute"].items()),
                         f"link: {inside.source}: {inside.gb_s:.2f} GB/s, {inside.latency_us:.0f} us per ring step",
                         f"overlap {overlap}"])


_FLOPS: dict[tuple, dict] = {}


def evaluate(cand: Candidate, train_argv: list[str], world: int, per_node: int, budget_gb: float,
             device: Device, bucket_mib: float = 25.0, counted: dict | None = None) -> dict:
    """One candidate: resolved as train.py would (refused: `refused` says why), its peak estimated
    against the budget, its step time predicted part by part; its communication the theory's bytes cut
    by its buckets, or with `counted` (analysis.project.count_flags) the calls and bytes counted."""
    from estimator.estimate import estimate_from_record
    from analysis.project import _offload_seconds, price_comm
    from core.config import interval_choices
    from core.flops import sample_flops
    from training.describe import MODEL_FIELDS, resolve_flags

    row = {"config": cand.config, "micro x accum": f"{cand.micro_batch}x{cand.grad_accum}", "ckpt": cand.ckpt,
           "candidate": cand, **({"base": cand.base} if cand.base else {})}
    gpu = device.flops_per_s is not None
    flags = [*train_argv, *cand.flags(), *(["--device", "cuda"] if gpu else [])]
    try:
        setup = resolve_flags(flags, world, per_node)
    except (ConfigError, DataError) as e:
        return {**row, "refused": str(e)}
    cfg, resolved = setup.cfg, setup.resolved
    est = estimate_from_record({**setup.record(), "environment": {"device": str(setup.env.device)}})
    limit = budget_gb * GiB * (1 - MARGIN)
    parts = {"model states": est.model_states_bytes, "activations": est.activation_bytes}
    parts["other"] = max(0, est.total_bytes - sum(parts.values()))
    breaks = max(parts, key=parts.get)
    row.update(est_peak_gb=est.total_bytes / GiB, margin_gb=budget_gb - est.total_bytes / GiB,
               fits=est.total_bytes <= limit,
               **({} if est.total_bytes <= limit else {"breaks": f"{breaks} {parts[breaks] / GiB:.3g} GiB of "
                                                              f"{est.total_bytes / GiB:.3g} GiB"}))
    samples = setup.layout.global_batch // world
    micro_steps = 0.0  # the calibrated fixed cost of the micro-steps (a named GPU's compute has none apart)
    if gpu:
        key = (tuple(getattr(cfg, f) for f in MODEL_FIELDS), cfg.ckpt_interval, cfg.ckpt_policy)
        if key not in _FLOPS:
            _FLOPS[key] = sample_flops(setup.workload, cfg.block_class, cfg.ckpt_interval,
                                       cfg.save_ops() if cfg.ckpt_policy == "selective" else None)
        flops = _FLOPS[key]
        compute = (flops["model"] + flops["recomputed"]) * samples / device.flops_per_s
    else:
        share = 0.0
        if cfg.ckpt_interval:  # the measured recompute of every block, for the share of blocks checkpointed
            n = len(est.activations.full) if est.activations is not None else 0
            checkpointed = sum(c != "none" for c in interval_choices(n, cfg.ckpt_interval))
            share = device.recompute.get(cfg.ckpt_policy, 0.0) * (checkpointed / n if n else 1.0)
        micro_steps = cand.grad_accum * device.micro_step_s * (1 + share)  # refit apart when accumulations differ
        compute = micro_steps + samples * device.sample_s * (1 + share) + device.optimizer_s
    traffic, comm, wait = price_comm(setup, world, per_node, (device.inside.gb_s, device.inside.latency_us),
                                     (device.between.gb_s, device.between.latency_us), bucket_mib, counted)
    offload = 0.0
    if device.pcie_gb_s is not None:
        from analysis.project import Assumptions

        offload = _offload_seconds(resolved, setup.n_params, world, {"pcie_gb_s": device.pcie_gb_s},
                                   Assumptions(cpu_adam_gparams_s=device.cpu_adam_gparams_s))
    step = compute + (1 - device.overlap) * comm + wait + offload
    row.update(backend=cfg.backend, bytes="counted" if counted is not None else "theory", calls=sum(t[2] for t in traffic.values()),
               comm_bus_bytes=sum(t[1] for t in traffic.values()),
               compute_ms=compute * 1e3, micro_steps_ms=micro_steps * 1e3,
               comm_ms=comm * 1e3, wait_ms=wait * 1e3,
               offload_ms=offload * 1e3,
               step_ms=step * 1e3, pred_samples_per_s=setup.layout.global_batch / step,
               command=command(flags, cfg.backend, world, per_node))
    return row


def command(flags: list[str], backend: str, world: int, per_node: int) -> str:
    """How a user launches the candidate (per node where it spans nodes)."""
    nproc = min(world, per_node)
    nodes = "" if world <= per_node else f" (on each of {world // per_node} nodes, with --nnodes and a rendezvous)"
    if backend == "single" or world == 1:
        head = ["python", "train.py"]
    elif backend == "deepspeed":
        head = ["deepspeed", "--num_gpus", str(nproc), "train.py"]
    else:
        head = ["torchrun", "--nproc_per_node", str(nproc), "train.py"]
    return shlex.join([*head, *flags]) + nodes


def plan(train_argv: list[str], world: int, per_node: int, budget_gb: float, global_batch: int, device: Device,
         configs: list[str] | None = None, ckpt: tuple[str, ...] = CKPT, micro_batches: list[int] | None = None,
         progress: bool = False, bases: dict[str, str] | None = None, counted: bool = False) -> list[dict]:
    """Every candidate evaluated; the ones that fit ranked by predicted samples/s first, then those
    over the budget, then those train.py refuses. `bases`: {a variant file: the configuration it varies}.
    `counted`: each fitting candidate's collectives counted as rank 0 of `world` under the fake process
    group (analysis.project.count_flags: a few seconds each, with its own flags); a count that fails
    leaves that candidate on the theory's bytes, saying why (`bytes`)."""
    from analysis.project import count_flags
    from training.fake_world import DEFAULT_FLAGS as COUNT_FLAGS

    cands = candidates(configs or configurations(world, per_node), world, global_batch, ckpt, micro_batches, bases)
    rows = []
    iterator = cands
    if progress:
        from tqdm import tqdm

        iterator = tqdm(cands, desc="candidates", unit="", file=sys.stderr, leave=False)
    for cand in iterator:
        row = evaluate(cand, train_argv, world, per_node, budget_gb, device)
        if counted and row.get("fits"):
            if progress:
                iterator.set_description(f"counting {cand.run_name()}")
            try:
                # fake_world's own short run, whatever --steps the user's flags carry
                count = count_flags([*train_argv, *cand.flags(), *COUNT_FLAGS], world, per_node, cand.run_name())
                row = evaluate(cand, train_argv, world, per_node, budget_gb, device, counted=count)
            except RuntimeError as e:
                row["bytes"] = f"theory ({e})"
            if progress:
                iterator.set_description("candidates")
        rows.append(row)
    return rank(rows)


def rank(rows: list[dict]) -> list[dict]:
    """Fitting candidates by predicted samples/s (then the lower peak), then those over the budget, then the refused."""
    return sorted(rows, key=lambda r: (0 if r.get("fits") else 1 if "refused" not in r else 2,
                                       -r.get("pred_samples_per_s", 0.0), r.get("est_peak_gb", 0.0)))


def to_verify(rows: list[dict], k: int) -> list[dict]:
    """The top `k` fitting candidates, and two from further down the fitting ones, to test the
    ranking: the best-ranked of each backend the top `k` leave out, then of each configuration
    (the model's largest errors are a configuration's own overhead, which the refit learns only
    from a run of it: on GPT-lite small here DDP's best ran 33% above ZeRO-2's and FSDP's with the
    same batch and checkpointing, predicted within 1%), else a third and two thirds of the way down."""
    fitting = [r for r in rows if r.get("fits")]
    top, rest = fitting[:k], fitting[k:]
    extra: list[dict] = []
    for family in (lambda r: r.get("backend"), lambda r: r.get("base") or r.get("config")):
        seen = {family(r) for r in top + extra}
        for r in rest:
            if len(extra) < 2 and family(r) not in seen and not any(r is e for e in extra):
                seen.add(family(r))
                extra.append(r)
    rest = [r for r in rest if not any(r is e for e in extra)]
    lower = sorted({len(rest) // 3, (2 * len(rest)) // 3}) if len(rest) > 1 else list(range(len(rest)))
    return top + extra + [rest[i] for i in lower][:2 - len(extra)]


def flag_pairs(argv: list[str]) -> tuple[tuple[str, object], ...]:
    """train.py's flags as (name, value) pairs, a switch's value True (training/sweep.PlannedRun.flags)."""
    pairs, i = [], 0
    while i < len(argv):
        name = argv[i]
        if not name.startswith("--"):
            raise ConfigError(f"{name}: expected a --flag")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((name[2:], argv[i + 1]))
            i += 2
        else:
            pairs.append((name[2:], True))
            i += 1
    return tuple(pairs)


# Slurm settings the plan's question decides (training/slurm.py FLAGS).
SLURM_OWN = ("nodes", "gpus_per_node")


def verify(rows: list[dict], k: int, train_argv: list[str], world: int, runs_dir: Path, steps: int,
           timeout_s: float, slurm=None, rounds: int = 1) -> list[dict]:
    """Run the top `k` candidates and two from further down (to_verify) through the sweep runner
    (training/runner.py: ordinary records under `runs_dir`, a progress line each; a record of the same
    run there is reused), each `steps` steps, `rounds` times taking turns here (the machine's speed
    drifts: each candidate's runs are spread over the whole verification), or with `slurm`
    (training/slurm.SlurmSettings) as Slurm jobs through the sweep's Slurm executor, all at once;
    predicted against measured, the median of a candidate's runs."""
    from training.runner import Runner
    from training.sweep import PlannedRun

    chosen = to_verify(rows, k)
    planned = []  # round by round: every candidate once, then again
    for rnd in range(rounds):
        for row in chosen:
            cand = row["candidate"]
            pairs = flag_pairs([*train_argv, *cand.flags()[2:], "--steps", str(steps), "--warmup_steps", "2",
                                "--mem_profile_steps", "1", "--eval_batches", "1"])
            name = f"plan-{cand.run_name()}" + (f"-r{rnd}" if rnd else "")
            planned.append((row, PlannedRun(name, row["backend"], cand.file, world, pairs)))
    runner = Runner(runs_dir, timeout_s)
    runner.hold_directory()
    try:
        outcomes = _on_slurm([run for _, run in planned], runs_dir, timeout_s, slurm) if slurm is not None else {}
        by_row: dict[int, list] = {}
        for i, (row, run) in enumerate(planned):
            if slurm is None:
                print(f"[{i + 1}/{len(planned)}] {run.name} (predicted rank {rows.index(row) + 1}) ...",
                      file=sys.stderr, flush=True)
                outcomes[run.name] = runner.run(run)
                print(f"[{i + 1}/{len(planned)}] {outcomes[run.name].line()}", file=sys.stderr, flush=True)
            by_row.setdefault(id(row), []).append((run, outcomes[run.name]))
    finally:
        runner.directory_lock.release()
    return [_measured(row, by_row[id(row)], runs_dir, rows.index(row) + 1) for row in chosen]


def _measured(row: dict, runs: list, runs_dir: Path, rank: int) -> dict:
    """A verified candidate from its runs: ok only if every run was; samples/s the median of its ok
    runs; its spread (two candidates whose spreads overlap are a tie): one run's, the quartiles of its
    timed steps; several runs', from the slowest run to the fastest (the machine's speed drifts
    between runs more than within one); the peak the highest, an oom run's too (its record keeps it)."""
    ok = [o.summary for _, o in runs if o.status == "ok" and o.summary.samples_per_s]
    status = next((o.status for _, o in runs if o.status != "ok"), "ok")
    if len(ok) > 1:
        spread = [min(s.samples_per_s for s in ok), max(s.samples_per_s for s in ok)]
    else:
        spread = [ok[0].samples_per_s_p25, ok[0].samples_per_s_p75] if ok else [None, None]
    peaks = [o.summary.mem_peak_bytes for _, o in runs if o.summary.mem_peak_bytes]
    label = " ".join(str(row[k]) for k in ("config", "micro x accum", "ckpt") if k in row)
    out = {"candidate": label, "command": row["command"],
           "record": str(runs_dir / runs[0][0].name), "status": status,
           "measured_samples_per_s": statistics.median(s.samples_per_s for s in ok) if ok else None,
           "pred_samples_per_s": row["pred_samples_per_s"], "measured_spread": spread,
           "measured_peak_gb": max(peaks) / GiB if peaks else None, "est_peak_gb": row["est_peak_gb"], "rank": rank}
    if len(runs) > 1:
        out["records"] = [str(runs_dir / run.name) for run, _ in runs]
        out["measured_runs"] = [o.summary.samples_per_s if o.status == "ok" else None for _, o in runs]
    return out


def _on_slurm(planned: list, runs_dir: Path, timeout_s: float, settings) -> dict:
    """The verifying runs as Slurm jobs, followed to their end: {run name: Outcome} (a run recorded
    before, by the same settings, is not submitted again)."""
    from training.slurm import SlurmSweep

    sweep = SlurmSweep("plan", runs_dir, timeout_s, planned, settings)
    sweep.check()
    outcomes = sweep.run_all(lambda line: print(line, file=sys.stderr, flush=True))
    return {o.run.name: o for o in outcomes}


def _bounded_lstsq(a, b, lower, upper):
    """min |a x - b| over lower <= x <= upper, exactly, for the few unknowns of a refit: each unknown
    free or held at one of its bounds, the free ones solved by least squares, the best feasible kept
    (the first of equals: a column of zeros, one rank's communication, is solved to 0)."""
    import itertools

    import numpy as np

    best = None
    for states in itertools.product((None, 0, 1), repeat=a.shape[1]):
        x = np.array([0.0 if s is None else (lower, upper)[s][i] for i, s in enumerate(states)])
        if not np.all(np.isfinite(x)):
            continue
        free = [i for i, s in enumerate(states) if s is None]
        if free:
            x[free] = np.linalg.lstsq(a[:, free], b - a @ x, rcond=None)[0]
        if np.all(x >= np.array(lower) - 1e-12) and np.all(x <= np.array(upper) + 1e-12):
            residual = float(np.sum((a @ x - b) ** 2))
            if best is None or residual < best[0] * (1 - 1e-9) - 1e-30:
                best = (residual, x)
    return np.clip(best[1], lower, upper)


def refit(rows: list[dict], verified: list[dict], global_batch: int) -> dict | None:
    """The step-time model's free parameters refitted on the verified runs: a factor on compute (the
    calibration ran alone; ranks share the machine) and the share of communication not hidden
    (1 - overlap, within [0, 1]), least squares on the step time; where the verified runs accumulate
    differently and determine it with a run to spare, the calibrated micro-steps' fixed cost
    (`micro_steps_ms`) gets a factor of its own (an H100's calibration put 26 ms on each where the
    runs said 6.5, and the one factor left 8 x 8 26% under:
    runs/reference/nvidia-h100-80gb-hbm3-plan); then each verified configuration's own overhead, the
    median of its runs' measured step over the refitted one (a wrapper's hooks, a ZeRO-3 gather the
    byte count does not price), applied to its every candidate (1 for a configuration not verified;
    a --variants file counts as the configuration it varies). Each candidate's `refit_samples_per_s`
    is then the refitted prediction, and the fitting candidates are re-ranked by it. None with fewer
    than 2 measured runs."""
    import numpy as np

    by_command = {r["command"]: r for r in rows if "command" in r}
    points = [(by_command[v["command"]], global_batch / v["measured_samples_per_s"]) for v in verified
              if v["status"] == "ok" and v.get("measured_samples_per_s")]
    if len(points) < 2:
        return None
    def columns(r: dict, split: bool) -> list[float]:  # compute (less its micro-steps' fixed cost), comm
        fixed = r.get("micro_steps_ms", 0.0) if split else 0.0
        return [(r["compute_ms"] - fixed) / 1e3, r["comm_ms"] / 1e3, *([fixed / 1e3] if split else [])]

    # The split only where the runs determine it, with a run to spare: they accumulate differently, and
    # the parts they have (one rank has no communication) are not proportional across them (every run
    # DDP without checkpointing: the rest of compute and comm both constant).
    a = np.array([columns(r, True) for r, _ in points])
    used = np.abs(a).max(axis=0) > 0
    scaled = a[:, used] / np.abs(a[:, used]).max(axis=0)
    split = bool(used[2] and len({r.get("micro x accum", "").partition("x")[2] for r, _ in points}) > 1
                 and np.linalg.matrix_rank(scaled, tol=1e-6 * len(points)) == used.sum() < len(points))
    a = np.array([columns(r, split) for r, _ in points])
    b = np.array([step - (r["offload_ms"] + r.get("wait_ms", 0.0)) / 1e3 for r, step in points])
    x = _bounded_lstsq(a, b, [1e-6, 0.0, *([0.0] if split else [])], [np.inf, 1.0, *([np.inf] if split else [])])
    factor, exposed = float(x[0]), float(x[1])
    fixed_factor = float(x[2]) if split else factor

    def step_of(r: dict) -> float:
        waiting = r["offload_ms"] + r.get("wait_ms", 0.0)  # neither overlaps compute
        return float(np.dot([factor, exposed, *([fixed_factor] if split else [])], columns(r, split))) + waiting / 1e3

    ratios: dict[str, list[float]] = {}
    for r, step in points:  # a variant shares the overhead of the configuration it varies
        ratios.setdefault(r.get("base") or r.get("config"), []).append(step / step_of(r))
    overhead = {config: statistics.median(x) for config, x in ratios.items()}
    for r in rows:
        if "compute_ms" in r:
            r["refit_samples_per_s"] = global_batch / (step_of(r) * overhead.get(r.get("base") or r.get("config"), 1.0))
    for v in verified:
        v["refit_samples_per_s"] = by_command[v["command"]].get("refit_samples_per_s")
    return {"compute_factor": factor, "overlap": 1 - exposed, "overhead": overhead, "runs": len(points),
            **({"micro_step_factor": fixed_factor} if split else {})}


def replay(saved: dict) -> dict:
    """A saved plan (--json's object, with its verified runs) refitted by this code's refit, without
    running anything: each candidate's parts as the plan printed them, its verified runs as measured.
    A plan saved before its candidates carried `micro_steps_ms` gets it rebuilt from its calibration
    (`calibration`, or the line `assumptions` printed): a candidate's calibrated compute is (fixed x
    accumulation + per sample x samples) x (1 + recompute) + the optimizer step, so its micro-steps'
    share of the rest is fixed x accumulation over the bracket. Returns the refit's parameters and,
    for each verified run, the prediction as the plan ran it, as this refit puts it, and measured."""
    rows = [dict(c) for c in saved["candidates"]]
    verified = [dict(v) for v in saved.get("verified", [])]
    timed = [r for r in rows if r.get("step_ms")]
    if not verified or not timed:
        raise ValueError("the plan has no verified runs or no timed candidates to refit on")
    # the question's global batch: every candidate's samples/s is it over its step
    global_batch = round(timed[0]["pred_samples_per_s"] * timed[0]["step_ms"] / 1e3)
    cal = saved.get("calibration")
    if cal is None and any("micro_steps_ms" not in r for r in timed):
        line = next((a for a in saved.get("assumptions", []) if "ms per micro-step" in a), "")
        got = CALIBRATION_LINE.search(line)
        cal = got and {"micro_step_s": float(got[1]) / 1e3, "sample_s": float(got[2]) / 1e3,
                       "optimizer_s": float(got[3]) / 1e3}
    for r in timed:
        if "micro_steps_ms" in r:
            continue
        if not cal:  # a named GPU's compute has no fixed part apart
            r["micro_steps_ms"] = 0.0
            continue
        micro, accum = (int(x) for x in r["micro x accum"].split("x"))
        fixed, per_sample = accum * cal["micro_step_s"], micro * accum * cal["sample_s"]
        bracket = fixed + per_sample
        r["micro_steps_ms"] = (r["compute_ms"] - cal["optimizer_s"] * 1e3) * fixed / bracket if bracket else 0.0
    as_ran = {v["command"]: v.get("refit_samples_per_s") for v in verified}
    fitted = refit(rows, verified, global_batch)
    if fitted is None:
        raise ValueError("the plan has fewer than 2 verified runs measured: nothing to refit")
    runs = [{"command": v["command"], "pred_samples_per_s": v["pred_samples_per_s"],
             "refit_as_ran": as_ran[v["command"]], "refit_samples_per_s": v.get("refit_samples_per_s"),
             "measured_samples_per_s": v["measured_samples_per_s"]}
            for v in verified if v["status"] == "ok" and v.get("measured_samples_per_s")]
    return {"global_batch": global_batch, "refit": fitted, "refit_as_ran": saved.get("refit"), "verified": runs,
            "candidates": rows}


def main(argv=None) -> int:
    from analysis.project import HARDWARE
    from training.cli import OneLineParser

    hw = yaml.safe_load(HARDWARE.read_text())
    p = OneLineParser(prog="python -m analysis.plan", description=__doc__.splitlines()[0], allow_abbrev=False,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      usage="python -m analysis.plan --world W --mem_budget_gb M --global_batch B [--gpu GPU|here] "
                            "[--configs C ...] [--variants DIR] [--ckpt P ...] [--top N] [--json] [train.py's model flags]",
                      epilog="Every other flag is train.py's, with train.py's names and defaults (the model: --model, "
                             "--preset, --model_args, --block_size, --precision, --attention, ...: python train.py "
                             "--help). What the planner chooses (the backend and its file, --micro_batch, "
                             "--grad_accum, checkpointing) is refused among them.\n\n" + __doc__.split("\n\n", 2)[2])
    p.add_argument("--world", type=int, required=True, help="ranks (GPUs) the run is launched on")
    p.add_argument("--gpus_per_node", type=int, default=None, help="ranks per node (default: the GPU's node, "
                   "hardware.yaml; --gpu here: --world)")
    p.add_argument("--gpu", default="here", choices=("here", *hw["gpus"]),
                   help="a GPU of analysis/hardware.yaml, or here: this machine, its compute calibrated and its link probed")
    p.add_argument("--network", default="infiniband-ndr", choices=tuple(hw["networks"]), help="between nodes")
    p.add_argument("--mem_budget_gb", type=float, required=True, help="memory per rank, GiB (train.py's flag)")
    p.add_argument("--global_batch", type=int, required=True,
                   help="samples per optimizer step, fixed as a recipe fixes it: micro x accumulation x world")
    p.add_argument("--configs", nargs="+", default=None, metavar="CONFIG",
                   help="single, ddp, fsdp, fsdp2, or fsdp_configs/ and ds_configs/ files (default: all shipped)")
    p.add_argument("--variants", default=None, metavar="DIR",
                   help="also plan the variants of the configurations that change speed or memory, written into DIR "
                        "as files the commands name: DDP's buckets a quarter and 4x its 25 MiB (--ddp_bucket_cap_mb: "
                        "flags, no file), DeepSpeed ZeRO-1/2 reduce buckets a quarter and 4x the file's, ZeRO-3 "
                        "without prefetch and with 100x the file's persistence threshold (priced with --counted), "
                        "FSDP FULL_SHARD/HYBRID_SHARD without backward prefetch")
    p.add_argument("--counted", action="store_true",
                   help="price each fitting candidate's real collectives (calls and bytes), counted by running it as rank "
                        "0 of --world under the fake process group (training.fake_world: a few seconds each), not the "
                        "theory's bytes cut by the configuration's buckets: "
                        "ZeRO-3's and FSDP's gathers go module by module")
    p.add_argument("--ckpt", nargs="+", default=list(CKPT), metavar="P",
                   help="checkpointing candidates: none, full/K, selective/K (every K-th block)")
    p.add_argument("--micro_batches", type=int, nargs="+", default=None, help="only these micro-batches")
    p.add_argument("--mfu", type=float, default=0.4, help="a named GPU's model FLOPs utilisation")
    p.add_argument("--overlap", type=float, default=0.5, help="share of communication hidden behind compute")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="also write DIR/plan.md (the tables and the pick) and DIR/plan.png (every candidate's estimated "
                        "peak against its predicted samples/s, the frontier, the budget, the verified runs as measured)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table shown")
    p.add_argument("--json", action="store_true", help="print one JSON object: candidates (ranked) and pick, "
                   "and with --verify, verified")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="run the top K candidates and two from further down on this machine (--gpu here), as "
                        "ordinary records under --runs_dir, and pick the fastest measured one within the budget")
    p.add_argument("--verify_steps", type=int, default=8, help="steps of each verifying run (2 warm-up steps and the "
                   "last, profiled for memory, are not timed)")
    p.add_argument("--verify_rounds", type=int, default=1, metavar="R",
                   help="run each verified candidate R times, taking turns (every candidate once, then again): its "
                        "samples/s is the median of its runs, its spread their range (this machine's speed "
                        "drifts between runs more than within one)")
    p.add_argument("--runs_dir", default="runs/plan", help="where verifying runs are recorded")
    p.add_argument("--timeout_s", type=float, default=900, help="each verifying run's limit")
    from training.slurm import add_flags

    # --verify's runs as Slurm jobs (on nodes like this machine: the calibration's); a run's shape
    # is the plan's own (--world, --gpus_per_node).
    add_flags(p, where="the executor's default", skip=SLURM_OWN)
    args, train_argv = p.parse_known_args(argv)
    if args.world < 1 or args.global_batch < 1:
        p.error("--world and --global_batch must be >= 1")
    if not (math.isfinite(args.mem_budget_gb) and args.mem_budget_gb > 0):
        p.error(f"--mem_budget_gb must be a number of GiB > 0 (got {args.mem_budget_gb:g})")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        p.error(f"--gpus_per_node must be >= 1 (got {args.gpus_per_node})")
    if not 0 < args.mfu <= 1 or not 0 <= args.overlap <= 1:
        p.error("--mfu must be in (0, 1], --overlap in [0, 1]")
    if args.top < 1:
        p.error(f"--top must be >= 1 (got {args.top}): the rows of the ranked table shown")
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        p.error(f"--timeout_s must be a number of seconds > 0 (got {args.timeout_s:g}): each verifying run's limit")
    for flag, values in (("--configs", args.configs or []), ("--ckpt", args.ckpt), ("--micro_batches", args.micro_batches or [])):
        twice = next((v for v in values if values.count(v) > 1), None)
        if twice is not None:
            p.error(f"{flag}: each at most once ({twice} is given {values.count(twice)} times)")
    for m in args.micro_batches or []:
        if m < 1:
            p.error(f"--micro_batches: each >= 1 (got {m})")
    for c in args.configs or []:
        try:
            _check_config(c)
        except ConfigError as e:
            p.error(str(e))
    if args.verify and args.gpu != "here":
        p.error("--verify runs the candidates on this machine: it needs --gpu here")
    if args.verify_rounds != 1 and not args.verify:
        p.error("--verify_rounds: it repeats the runs of --verify K; give --verify too")
    if args.verify < 0 or args.verify_steps < 4 or args.verify_rounds < 1:
        p.error("--verify must be >= 0, --verify_rounds >= 1 and --verify_steps >= 4 (2 warm-up steps and the "
                "profiled last one are not timed)")
    if args.gpu == "here" and args.gpus_per_node is not None and args.gpus_per_node < args.world:
        p.error("--gpus_per_node: --gpu here plans on this machine, one node of all --world ranks")
    if args.out:  # before any calibration or run: bad input records nothing
        from training.preflight import writable_out

        try:
            writable_out("--out", args.out)
        except ConfigError as e:
            p.error(str(e))
    per_node = args.gpus_per_node or (args.world if args.gpu == "here" else hw["gpus"][args.gpu]["gpus_per_node"])
    try:
        from training.cli import config_from_argv

        given, defaults = config_from_argv(train_argv), config_from_argv([])
        for name in CHOSEN_FLAGS:
            if getattr(given, name) != getattr(defaults, name):
                raise ConfigError(f"--{name}: the planner chooses it (--configs, --micro_batches, --ckpt narrow the choice)")
        for name in RUN_OWN_FLAGS:
            if getattr(given, name) != getattr(defaults, name):
                raise ConfigError(f"--{name}: one run's own, not the model's: every candidate's command would carry it "
                                  "(add it to the command you pick)")
        ckpt = tuple(Candidate("ddp", 1, 1, k).ckpt for k in args.ckpt)
        if args.ckpt != list(CKPT):
            _check_ckpt_within_blocks(ckpt, given)
        configs = args.configs or configurations(args.world, per_node)
        asked = candidates(configs, args.world, args.global_batch, ckpt, args.micro_batches)  # the question checked first
        slurm = None
        if args.verify and args.executor == "slurm":  # checked before anything is written or run
            from training.slurm import SlurmSettings, settings_from

            slurm = settings_from(SlurmSettings(), args, skip=SLURM_OWN)
        bases = write_variants(configs, args.variants) if args.variants else {}
        configs = [*configs, *bases]
        if args.gpu == "here":
            if not args.json:
                print("calibrating this machine (the model's step timed; the link between its ranks probed) ...",
                      file=sys.stderr, flush=True)
            device = here_device(train_argv, args.world, per_node, args.overlap,
                                 sorted({c.micro_batch for c in asked}))
        else:
            device = named_device(args.gpu, args.network, args.mfu, args.overlap, given.precision)
        rows = plan(train_argv, args.world, per_node, args.mem_budget_gb, args.global_batch, device, configs, ckpt,
                    args.micro_batches, progress=not args.json, bases=bases, counted=args.counted)
        if args.counted:
            failed = sorted({r["bytes"] for r in rows if r.get("bytes", "").startswith("theory (")})
            device.notes.append(f"comm: the fitting candidates' collectives counted as rank 0 of {args.world} under "
                                "the fake process group" + (f"; not counted, on the theory's bytes: {'; '.join(failed)}"
                                                             if failed else ""))
        fitting = [r for r in rows if r.get("fits")]
        verified, fitted = [], None
        if args.verify and fitting:
            if not args.json:
                _print_table(rows, fitting, device, args)
                rounds = f", {args.verify_rounds} rounds" if args.verify_rounds > 1 else ""
                print(f"\nverifying: the top {args.verify} and two further down, {args.verify_steps} steps each"
                      f"{rounds}, into {args.runs_dir}", flush=True)
            verified = verify(rows, args.verify, train_argv, args.world, Path(args.runs_dir).resolve(), args.verify_steps,
                              args.timeout_s, slurm, args.verify_rounds)
            fitted = refit(rows, verified, args.global_batch)
    except (ConfigError, DataError) as e:
        p.error(str(e))
    except RuntimeError as e:
        print(f"python -m analysis.plan: {e}", file=sys.stderr)
        return 1
    within = [v for v in verified if v["status"] == "ok" and v["measured_peak_gb"] is not None
              and v["measured_peak_gb"] <= args.mem_budget_gb]
    best = max(within, key=lambda v: v["measured_samples_per_s"] or 0.0, default=None)
    pick = best["command"] if best else (fitting[0]["command"] if fitting and not args.verify else None)
    ties = _ties(best, within)
    if args.out:
        try:
            write_out(Path(args.out), rows, fitting, device, args, verified, fitted, pick, ties,
                      sys.argv[1:] if argv is None else argv)
        except OSError as e:
            p.error(f"--out {args.out}: cannot write there ({e.strerror or e})")
    if args.json:
        shown = [{**{k: v for k, v in r.items() if k != "candidate"}, "config_flags": r["candidate"].flags()}
                 for r in rows]
        calibration = ({"calibration": {"micro_step_s": device.micro_step_s, "sample_s": device.sample_s,
                                        "optimizer_s": device.optimizer_s, "recompute": device.recompute}}
                       if device.flops_per_s is None else {})  # what replay() needs to re-price the plan
        print(json.dumps({"device": device.name, "assumptions": device.notes, **calibration, "candidates": shown,
                          "pick": pick,
                          **({"verified": verified, "refit": fitted, "ties_with_pick": ties} if args.verify else {})},
                         indent=2))
        return 0 if pick else 1
    if args.verify and fitting:
        _print_verified(verified, fitted, fitting, pick, ties)
        return 0 if pick else 1
    return _print_table(rows, fitting, device, args)


def _print_verified(verified: list[dict], fitted: dict | None, fitting: list[dict], pick: str | None,
                    ties: list[str], file=None) -> None:
    import pandas as pd

    print = functools.partial(builtins.print, file=file or sys.stdout)
    print("\npredicted against measured (peaks in GiB; each candidate's command below the table):")
    table = pd.DataFrame(verified).drop(columns=["record", "records", "measured_spread", "command"], errors="ignore")
    table.insert(0, "#", range(1, len(verified) + 1))
    if "measured_runs" in table:  # each run's samples/s, in the order they ran
        table["measured_runs"] = ["/".join("-" if x is None else f"{x:.3g}" for x in runs)
                                  for runs in table["measured_runs"]]
    # The spread over the median: one run's timed steps' interquartile range, or its runs' range.
    table.insert(table.columns.get_loc("measured_samples_per_s") + 1, "spread",
                 [(v["measured_spread"][1] - v["measured_spread"][0]) / v["measured_samples_per_s"]
                  if v["measured_samples_per_s"] and None not in v["measured_spread"] else None for v in verified])
    print(table.to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
    for i, v in enumerate(verified, 1):  # a command is 100-200 characters: never a column
        print(f"  {i}: {v['command']}")
    if fitted:
        overhead = ", ".join(f"{c} x {o:.3g}" for c, o in fitted["overhead"].items())
        steps = (f" (its micro-steps' fixed cost x {fitted['micro_step_factor']:.3g})"
                 if "micro_step_factor" in fitted else "")
        print(f"\nrefitted on {fitted['runs']} verified candidates: compute x {fitted['compute_factor']:.3g}{steps}, overlap "
              f"{fitted['overlap']:.2f}; each verified configuration's overhead: {overhead}; re-ranked, "
              f"the top {min(5, len(fitting))}:")
        again = sorted(fitting, key=lambda r: -r["refit_samples_per_s"])[:5]
        print(pd.DataFrame(again)[["config", "micro x accum", "ckpt", "est_peak_gb", "pred_samples_per_s",
                                   "refit_samples_per_s"]].to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
    print("\npick (fastest measured within the budget):", pick or "none of the verified runs")
    for command in ties:
        print(f"  a tie, not a win: {command} (its spread overlaps the pick's)")


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, samples/s) points no other point beats on both: less memory and more samples/s,
    by increasing memory."""
    best, out = -math.inf, []
    for mem, rate in sorted(points, key=lambda p: (p[0], -p[1])):
        if rate > best:
            out.append((mem, rate))
            best = rate
    return out


def write_out(out: Path, rows: list[dict], fitting: list[dict], device: Device, args, verified: list[dict],
              fitted: dict | None, pick: str | None, ties: list[str], argv: list[str]) -> None:
    """--out DIR: plan.md (the ranked table, what was verified, the pick) and plan.png (every
    candidate's estimated peak against its predicted samples/s, the frontier, the budget, and the
    verified runs as measured)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    out.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    _print_table(rows, fitting, device, args, file=text)
    if args.verify and fitting:
        _print_verified(verified, fitted, fitting, pick, ties, file=text)
    shown = [r for r in rows if "pred_samples_per_s" in r]
    # After --verify's refit, every candidate where the refitted model puts it.
    speed, said = ("refit_samples_per_s", "refitted") if fitted else ("pred_samples_per_s", "predicted")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    if shown:
        frame = {"estimated peak per rank (GiB)": [r["est_peak_gb"] for r in shown],
                 f"{said} samples/s": [r[speed] for r in shown],
                 "config": [r["config"] for r in shown],
                 "fits": ["fits" if r.get("fits") else "over the budget" for r in shown]}
        sns.scatterplot(frame, x="estimated peak per rank (GiB)", y=f"{said} samples/s", hue="config", style="fits",
                        style_order=["fits", "over the budget"], ax=ax, s=40)
        edge = frontier([(r["est_peak_gb"], r[speed]) for r in shown])
        ax.plot(*zip(*edge), color="grey", drawstyle="steps-post", linewidth=1, label=f"frontier ({said})")
    ax.axvline(args.mem_budget_gb, color="red", linestyle="--", linewidth=1, label=f"budget {args.mem_budget_gb:g} GiB")
    ax.axvline(args.mem_budget_gb * (1 - MARGIN), color="red", linestyle=":", linewidth=1,
               label=f"budget less the estimator's band ({MARGIN:.0%})")
    measured = [v for v in verified if v.get("measured_samples_per_s") and v.get("measured_peak_gb") is not None]
    if measured:
        ax.scatter([v["measured_peak_gb"] for v in measured], [v["measured_samples_per_s"] for v in measured],
                   marker="x", color="black", s=60, label="verified: measured")
    chosen = next((v for v in measured if v["command"] == pick), None) or \
        next((r for r in shown if r.get("command") == pick and not verified), None)
    if chosen:
        x = chosen.get("measured_peak_gb", chosen.get("est_peak_gb"))
        y = chosen.get("measured_samples_per_s", chosen.get(speed))
        ax.scatter([x], [y], marker="*", color="gold", edgecolor="black", s=250, zorder=5, label="pick")
    ax.set(title=f"{len(rows)} candidates, world {args.world}, global batch {args.global_batch}, on {device.name}",
           xlabel="peak per rank, GiB (estimated; verified runs: measured)",
           ylabel=f"samples/s ({said}; verified runs: measured)")
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(out / "plan.png", dpi=110)
    plt.close(fig)
    (out / "plan.md").write_text(
        f"# Plan: world {args.world}, budget {args.mem_budget_gb:g} GiB per rank, global batch {args.global_batch}\n\n"
        f"`python -m analysis.plan {shlex.join(argv)}`\n\n"
        f"```\n{text.getvalue().strip()}\n```\n\n"
        + (f"Pick:\n\n```\n{pick}\n```\n\n" if pick else "No pick: no candidate fits.\n\n")
        + f"![estimated peak against {said} samples/s](plan.png)\n")


def _ties(best: dict | None, within: list[dict]) -> list[str]:
    """The commands of the verified runs within the budget whose measured spread (one run's timed
    steps' quartiles of samples/s, or its runs' range: _measured) overlaps the pick's: as fast as the
    pick within the noise of the measurement."""
    from analysis.tables import within_spread

    if best is None:
        return []
    return [v["command"] for v in within if v is not best
            and within_spread(tuple(v.get("measured_spread") or (None, None)),
                              tuple(best.get("measured_spread") or (None, None)))]


def _print_table(rows: list[dict], fitting: list[dict], device: Device, args, file=None) -> int:
    print = functools.partial(builtins.print, file=file or sys.stdout)
    print(f"{len(rows)} candidates on {device.name}, world {args.world}, budget {args.mem_budget_gb:g} GiB per rank, "
          f"global batch {args.global_batch}: {len(fitting)} fit, "
          f"{sum('breaks' in r for r in rows)} over the budget, {sum('refused' in r for r in rows)} refused by train.py")
    for note in device.notes:
        print(f"  {note}")
    if fitting:
        import pandas as pd

        columns = ["config", "micro x accum", "ckpt", "est_peak_gb", "margin_gb", "compute_ms", "comm_ms", "wait_ms",
                   "offload_ms", "step_ms", "pred_samples_per_s"]
        table = pd.DataFrame(fitting[:args.top])[columns]
        print(table.to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
        print("\npredicted pick:" if args.verify else "\npick:", fitting[0]["command"])
    else:
        least = min((r for r in rows if "est_peak_gb" in r), key=lambda r: r["est_peak_gb"], default=None)
        print("no candidate fits" + (f": the smallest estimated peak is {least['est_peak_gb']:.3g} GiB "
                                     f"({least['command']}; {least['breaks']})" if least else ""))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
