"""Project a model's training to W GPUs of a named kind and network, for every backend.

    python -m analysis.project --world 8 64 --gpu H100-SXM --network infiniband-ndr \\
        --preset paper --micro_batch 1 --precision bf16 --attention sdpa
    python -m analysis.project --world 8 --gpu H100-SXM --out reports/project --preset paper --micro_batch 1 --precision bf16
    python -m analysis.project --world 8 64 --gpu H100-SXM --counted --configs ddp ds_configs/z3.json --preset tiny
    python -m analysis.project --world 8 --gpu A100-SXM --model hf:llama --model_args num_hidden_layers=8,hidden_size=1024 \\
        --precision bf16

The run is train.py's flags (any model that trains: GPT-lite, hf:, a model file; train.py's names and
defaults), resolved for each configuration as the run resolves it (simulation/describe.py).
For each backend configuration (ddp and every shipped fsdp_configs/ and ds_configs/ file), on W
ranks (W / gpus_per_node nodes): per-rank memory (analysis.estimate_cli), the bytes of a step's
collectives by kind (each backend's own theory: Backend.comm_theory, the accounting the measured
runs are checked against, tests/unit/test_comm.py; or, with --counted, the backend's real collectives at
W, counted by running it as rank 0 of W under torch's fake process group, simulation/fake_world.py),
and a step time:

    compute   = FLOPs per sample (GPT-lite's formula, any other model counted on fake tensors, plus what
                checkpointing recomputes) x samples per rank / (peak of the precision x MFU)
    comm      = per kind: alpha x ring steps x calls + bus bytes / bandwidth of the slowest link
                (NVLink when the kind's group fits in a node, else the network's share per GPU)
                cut into calls by the configuration's own bucket sizes where it names them; the share
                each backend's schedule puts on the critical path (Backend.comm_schedule: a collective
                after backward or in the optimizer step, a gather nothing prefetches) is `wait`, the
                rest `comm`
    offload   = host<->device bytes / PCIe bandwidth + the CPU optimizer's time (ZeRO-Offload, FSDP
                CPU offload)
    step      = compute + (1 - overlap) x comm + wait + offload

samples/s = global batch / step. Every assumption (MFU, overlap, bucket size, CPU Adam speed, the
hardware table analysis/hardware.yaml, datasheet figures) is printed with the result: this is a
model for comparing backends, checked only where runs can measure (the bytes, tests/unit/test_comm.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import yaml

from analysis.runs import config_label
from backends import BACKEND_NAMES, DDP, deepspeed_config, fsdp_config, get_backend
from backends.activation_checkpointing import save_ops_for
from core.comm import base_kind
from core.flops import planned_sample_flops, sample_flops
from estimator.checkpointing_plan import plan_for_record
from estimator.estimate import estimate_from_record
from gptlite.data import DataError
from gptlite.errors import ConfigError
from orchestration import launch
from training.cli import OneLineParser, config_from_argv, refuse_renamed
from simulation.describe import resolve_flags
from training.preflight import writable_out

REPO = Path(__file__).resolve().parent.parent
HARDWARE = Path(__file__).resolve().parent / "hardware.yaml"
RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # x (g - 1)
# The article's measurements (8 GPUs, micro-batch 1, samples/s), for comparison, not fitting.
# By configuration label (analysis.runs.config_label).
ARTICLE = {DDP: 11.45, "deepspeed.z1": 11.07, "deepspeed.z2": 10.44, "deepspeed.z3": 7.1,
           "deepspeed.z3_infinity": 6.2}


@dataclass
class Assumptions:
    mfu: float = 0.4  # measured 0.26-0.40 on one H100 for the paper preset (runs/reference/)
    overlap: float = 0.5  # share of communication hidden behind compute
    bucket_mib: float = 25.0  # message size where the configuration names none (FSDP's units, ZeRO-3's modules)
    cpu_adam_gparams_s: float = 1.0  # billions of parameters a CPU Adam steps per second per GPU


HERE = "here"  # --gpu's default: this machine's device


def add_gpu_flag(p, hw: dict) -> None:
    """--gpu, one name, default and meaning for every tool that predicts (this projection, the planner):
    the device the prediction is for."""
    p.add_argument("--gpu", default=HERE, choices=(HERE, *hw["gpus"]),
                   help="the device the prediction is for: here, this machine's (the planner calibrates it and "
                        "probes the link between its ranks once, keeping it with the backend costs; the "
                        "projection, to W GPUs, takes its kind from analysis/hardware.yaml), or a GPU of "
                        "analysis/hardware.yaml (default: here)")


def gpu_here(hw: dict, device_name: str | None = None) -> str | None:
    """This machine's GPU as analysis/hardware.yaml names it ('NVIDIA H100 80GB HBM3' is H100-SXM),
    from `device_name` or CUDA's device 0; None without a GPU or for one the file does not list."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name(0)
    words = device_name.upper().replace("-", " ").split()
    return next((key for key in hw["gpus"] if key.upper().split("-")[0] in words), None)


def add_cost_flags(p, hw: dict) -> None:
    """The flags a step-time prediction takes beside the GPU, one name, default and meaning for every
    tool that predicts (this projection and the planner): the network between nodes and the Assumptions."""
    p.add_argument("--network", default="infiniband-ndr", choices=tuple(hw["networks"]), help="between nodes")
    p.add_argument("--mfu", type=float, default=Assumptions.mfu,
                   help="a named GPU's model FLOPs utilisation (default: %(default)s)")
    p.add_argument("--overlap", type=float, default=Assumptions.overlap,
                   help="share of communication hidden behind compute (default: %(default)s)")


def kept_ops(cfg) -> tuple[str, ...] | None:
    """The ops a checkpointed block of run `cfg` keeps (None: full's inputs only), as train.py
    resolves them: the selective default set unless --ckpt_save_ops."""
    return save_ops_for(cfg.ckpt_policy, cfg.save_ops()) if cfg.ckpt_policy in ("full", "selective") else None


def configurations() -> list[str]:
    files = sorted((REPO / "fsdp_configs").glob("*.yaml")) + sorted((REPO / "ds_configs").glob("*.json"))
    # Left out: NVMe offload needs a drive and its path, DeepCompile a CUDA device (it compiles a
    # CUDA op); both can still be named with --configs.
    # DDP, priced by its name alone, the baseline.
    return [DDP, *(str(p.relative_to(REPO)) for p in files if "nvme" not in p.name and "deepcompile" not in p.name)]


_FLOPS: dict[tuple, dict] = {}

# train.py flags that choose the configuration: the projection's is --configs, one at a time. (deepspeed:
# the --deepspeed switch, a flag's name.)
CONFIG_FLAGS = ("backend", "fsdp_config", "deepspeed_config", "deepspeed", "accelerate_plugin")


def config_flags(entry: str, path: str | None = None) -> list[str]:
    """train.py's flags that select one configuration: a backend's name, or an fsdp_configs/ or
    ds_configs/ file (named as `path`, default `entry`)."""
    flag = {"yaml": "--fsdp_config", "json": "--deepspeed_config"}.get(entry.rsplit(".", 1)[-1])
    return [flag, path or entry] if flag else ["--backend", entry]


def run_flags(entry: str, train_argv: list[str]) -> list[str]:
    """train.py's flags for one configuration: the user's (`train_argv`, train.py's names and
    defaults) with the configuration's, on a GPU. The projection resolves them as the run would
    (simulation/describe.py), and --counted runs them."""
    return [*train_argv, *config_flags(entry, str(REPO / entry)), "--device", "cuda"]


def count(entry: str, train_argv: list[str], world: int, gpus_per_node: int) -> dict:
    """The configuration run as rank 0 of `world` under the fake process group (simulation/fake_world.py):
    its real collectives at that world size, and its memory peak on this machine's device."""
    return count_flags(run_flags(entry, train_argv), world, gpus_per_node, entry)


def count_flags(flags: list[str], world: int, gpus_per_node: int, what: str) -> dict:
    """train.py's `flags` run as rank 0 of `world` under the fake process group, on this machine's
    device (the same collectives): simulation/fake_world.py's result. Failing, a RuntimeError naming `what`."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = launch.run_python("-m", "simulation.fake_world", "--world", world, "--gpus_per_node", gpus_per_node,
                                 "--out", tmp, "--", *flags, "--device", "auto")
        out = Path(tmp) / "fake_world.json"
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{what} at {world} ranks under the fake process group failed: {tail}")
        return json.loads(out.read_text())


def counted_traffic(counted: dict, theory: dict, world: int) -> dict:
    """{kind: (group size, bus bytes, calls, spans nodes)} of a count (count_flags), each kind in the
    group its theory names first (the whole world where the theory has no such kind)."""
    groups: dict[str, tuple] = {}
    for kind, term in theory["by_kind"].items():
        groups.setdefault(base_kind(kind), (term["group_size"], term.get("spans_nodes")))
    return {kind: (groups.get(kind, (world, None))[0], v["bus_bytes"], v["calls"], groups.get(kind, (world, None))[1])
            for kind, v in counted["comm"]["collectives"].items()}


def resolve_entry(entry: str, train_argv: list[str], world: int, per_node: int):
    """training.run.Setup of configuration `entry` of the run `train_argv` on `world` GPUs, `per_node` to a
    node, resolved as train.py resolves it (simulation/describe.py), --ckpt_policy auto's plan included."""
    return resolve_flags(run_flags(entry, train_argv), world, per_node, planner=plan_for_record)


def project(entry: str, train_argv: list[str], world: int, gpu: dict, net: dict, nvlink_latency_us: float,
            a: Assumptions, counted: dict | None = None) -> dict:
    """One configuration of the run train.py's flags `train_argv` describe, on `world` GPUs: memory,
    bytes, step time and samples/s. With `counted` (a fake-process-group run, count()), the bytes and
    calls are the backend's real ones at that world size; otherwise its theory's, cut into calls by
    the configuration's own bucket sizes where it names them (Backend.comm_schedule), else
    a.bucket_mib; either way the share its schedule puts on the critical path is `wait ms`."""
    per_node = min(world, gpu["gpus_per_node"])
    setup = resolve_entry(entry, train_argv, world, per_node)
    resolved, cfg = setup.resolved, setup.cfg
    n_params = setup.n_params
    memory = estimate_from_record({**setup.record(), "environment": {"device": str(setup.env.device)}})
    # Hardware FLOPs per sample: the model's (GPT-lite's formula, any other model counted on fake
    # tensors) and what checkpointing runs again.
    key = (tuple(train_argv), cfg.ckpt_plan)
    if key not in _FLOPS:  # counted once per run and plan, whatever the configuration and world
        # A selective checkpoint keeps the ops the run resolves (its default set unless
        # --ckpt_save_ops), as train.py counts them (training/run.py).
        _FLOPS[key] = (planned_sample_flops(setup.workload, cfg.block_class, cfg.plan_choices(),
                                            save_ops_for("selective", cfg.save_ops()))
                       if cfg.ckpt_plan else
                       sample_flops(setup.workload, cfg.block_class, cfg.ckpt_interval,
                                    kept_ops(cfg)))
    flops = _FLOPS[key]
    samples = setup.layout.global_batch // world  # per rank per step: micro-batch x accumulation
    peak = gpu["fp32_tflops" if cfg.precision == "fp32" else "bf16_tflops"]
    compute_s = (flops["model"] + flops["recomputed"]) * samples / (peak * 1e12 * a.mfu)
    traffic, comm_s, wait_s = price_comm(setup, world, per_node, (gpu["nvlink_gb_s"], nvlink_latency_us),
                                         (net["gb_s_per_gpu"], net["latency_us"]), a.bucket_mib, counted)
    offload_s = offload_seconds(resolved, n_params, world, gpu, a)
    step_s = compute_s + (1 - a.overlap) * comm_s + wait_s + offload_s
    label = config_label(cfg.backend, cfg.fsdp_config, cfg.deepspeed_config, cfg.ddp_bucket_cap_mb)
    return {"config": label, "gpus": world, "nodes": math.ceil(world / per_node),
            "micro x accum": f"{cfg.micro_batch}x{samples // cfg.micro_batch}", "precision": cfg.precision,
            "memory GiB": memory.total_bytes / 2**30, "fits": memory.total_bytes <= gpu["memory_gib"] * 2**30,
            "comm GiB/step": sum(term[1] for term in traffic.values()) / 2**30,
            "inter-node GiB/step": inter_node_bytes(traffic, per_node) / 2**30,
            "bytes": "counted" if counted is not None else "theory",
            **({"counted peak GiB": counted["mem_peak_bytes"] / 2**30} if counted is not None else {}),
            "compute ms": compute_s * 1e3, "comm ms": comm_s * 1e3, "wait ms": wait_s * 1e3,
            "offload ms": offload_s * 1e3, "step ms": step_s * 1e3, "samples/s": world * samples / step_s}


def theory_traffic(theory: dict, bucket_mib: float, schedule: dict | None = None) -> dict:
    """{kind: (group size, bus bytes, calls, spans nodes)} of a backend's comm_theory, its bytes cut into
    calls of the bytes its `schedule` (Backend.comm_schedule) gives a kind, else of bucket_mib."""
    schedule = schedule or {}
    sizes = {kind: schedule.get(kind, schedule.get(base_kind(kind), (None, 0.0)))[0] or bucket_mib * 2**20
             for kind in theory["by_kind"]}
    return {kind: (term["group_size"], term["bus_bytes"], max(1, math.ceil(term["bytes"] / sizes[kind] - 1e-9)),
                   term.get("spans_nodes"))
            for kind, term in theory["by_kind"].items()}


def comm_seconds(traffic: dict, per_node: int, inside: tuple[float, float], between: tuple[float, float]) -> float:
    """Seconds of a step's collectives, `traffic` {kind: (group size, bus bytes, calls[, spans nodes])},
    over alpha-beta links: `inside` a node and `between` nodes, each (GB/s, latency in microseconds);
    a kind whose group lies in one node takes the inside link: where the theory says where its group
    lies (a replica group of HSDP spans nodes however few its ranks), else where it fits in a node."""
    seconds = 0.0
    for kind, (group, bus_bytes, calls, *placed) in traffic.items():
        if group <= 1:
            continue
        crosses = placed[0] if placed and placed[0] is not None else group > per_node
        gb_s, latency_us = between if crosses else inside
        seconds += latency_us * 1e-6 * RING_STEPS.get(base_kind(kind), 1) * (group - 1) * calls
        seconds += bus_bytes / (gb_s * 1e9)
    return seconds


def inter_node_bytes(traffic: dict, per_node: int) -> float:
    """Bus bytes per rank of `traffic` (theory_traffic, counted_traffic) over the link between nodes."""
    return sum(bus for group, bus, _, *placed in traffic.values()
               if group > 1 and (placed[0] if placed and placed[0] is not None else group > per_node))


def price_comm(setup, world: int, per_node: int, inside: tuple[float, float], between: tuple[float, float],
               bucket_mib: float, counted: dict | None = None) -> tuple[dict, float, float]:
    """A resolved run's (training.run.Setup) communication priced: (traffic, seconds that may overlap
    compute, seconds that wait), its collectives by theory cut by the configuration's buckets
    (theory_traffic) or, with `counted` (count_flags), as counted; the waiting shares from its
    backend's schedule (comm_and_wait). The projection and the planner both price a run by it."""
    backend = setup.resolved.build(setup.env)
    buffers = setup.workload.buffer_bytes
    theory = backend.comm_theory(setup.n_params, setup.workload.n_trainable, buffers)
    schedule = backend.comm_schedule(setup.workload.param_sizes, buffers)
    if counted is not None:
        traffic = counted_traffic(counted, theory, world)
    else:
        traffic = theory_traffic(theory, bucket_mib, schedule)
    return (traffic, *comm_and_wait(traffic, schedule, per_node, inside, between))


def comm_and_wait(traffic: dict, schedule: dict, per_node: int, inside: tuple[float, float],
                  between: tuple[float, float]) -> tuple[float, float]:
    """Seconds of `traffic` (comm_seconds) that may overlap compute and that wait on the critical path:
    each kind's waiting share from the backend's schedule (Backend.comm_schedule: DeepSpeed stage 0's
    all-reduce after backward, ZeRO-1/2's gather in the optimizer step, gathers nothing prefetches);
    a kind the schedule does not name overlaps."""
    comm = wait = 0.0
    for kind, term in traffic.items():
        seconds = comm_seconds({kind: term}, per_node, inside, between)
        waits = schedule.get(kind, schedule.get(base_kind(kind), (None, 0.0)))[1]
        comm, wait = comm + (1 - waits) * seconds, wait + waits * seconds
    return comm, wait


def offload_seconds(resolved, n_params: int, world: int, gpu: dict, a: Assumptions) -> float:
    """Host<->device traffic and the CPU optimizer step of the offloading configurations (what each
    backend offloads under its spec: Backend.offload)."""
    offload_opt, offload_params, shard = resolved.backend.offload(resolved.spec, n_params, world)
    if not offload_opt:
        return 0.0
    moved = shard * 2 * 2  # 16-bit gradients out, 16-bit parameters back
    if offload_params:
        moved += 2 * n_params * 2  # every parameter fetched for forward and again for backward
    return moved / (gpu["pcie_gb_s"] * 1e9) + shard / (a.cpu_adam_gparams_s * 1e9)


def table(train_argv: list[str], worlds: list[int], gpu_name: str, network: str, a: Assumptions,
          entries: list[str] | None = None, counted: bool = False, gpus_per_node: int | None = None):
    hw = yaml.safe_load(HARDWARE.read_text())
    gpu, net = hw["gpus"][gpu_name], hw["networks"][network]
    if gpus_per_node:
        gpu = {**gpu, "gpus_per_node": gpus_per_node}
    rows = []
    for w in worlds:
        for entry in entries or configurations():
            if not _runs_on(entry, w, gpu):
                continue
            if counted:
                print(f"counting {entry} at {w} ranks (fake process group) ...", file=sys.stderr, flush=True)
            run = count(entry, train_argv, w, gpu["gpus_per_node"]) if counted else None
            rows.append(project(entry, train_argv, w, gpu, net, hw["nvlink_latency_us"], a, run))
    return pd.DataFrame(rows)


def _runs_on(entry: str, world: int, gpu: dict) -> bool:
    return not (node_hybrid(entry) and world <= gpu["gpus_per_node"])  # one node: no replicas to hybridise


def node_hybrid(entry: str) -> bool:
    """Whether configuration `entry` shapes its groups by the node (the hybrid family: FSDP1's
    HYBRID_SHARD and _HYBRID_SHARD_ZERO2, FSDP2 on a mesh or resharding to a group): on one node
    it is FULL_SHARD or SHARD_GRAD_OP again. (ZeRO++'s hpZ partitions by its own number, so it
    differs from ZeRO-3 on one node too.)"""
    if not entry.endswith(".yaml"):
        return False
    path = Path(entry) if Path(entry).is_file() else REPO / entry
    options = fsdp_config.load(str(path))
    if isinstance(options, fsdp_config.FSDPConfig):
        return options.sharding_strategy in fsdp_config.HYBRID_STRATEGIES
    return options.mesh is not None or not isinstance(options.reshard_after_forward, bool)


def build_parser(hw: dict) -> OneLineParser:
    """The projection's own flags; every other flag is train.py's."""
    p = OneLineParser(prog="python -m analysis.project", description=__doc__.splitlines()[0], allow_abbrev=False,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      usage="python -m analysis.project [--world W ...] [--gpu GPU|here] [--network NET] [--configs C ...] "
                            "[--counted] [--out DIR] [train.py flags]",
                      epilog="Every other flag is train.py's, with train.py's names and defaults (the model, "
                             "--micro_batch, --grad_accum, --precision, --attention, checkpointing: python train.py "
                             "--help), resolved for each configuration as the run resolves it (simulation/describe.py), "
                             "on a GPU. The configuration itself is --configs'.\n\n" + "\n".join(__doc__.splitlines()[2:5]))
    p.add_argument("--world", type=int, nargs="+", default=[8, 64], help="world sizes (ranks, GPUs) to project to")
    add_gpu_flag(p, hw)
    p.add_argument("--gpus_per_node", type=int, default=None,
                   help="GPUs per node: where the intra-node link ends and the hybrid configurations' shard groups "
                        "(default: the GPU's in analysis/hardware.yaml)")
    add_cost_flags(p, hw)
    p.add_argument("--configs", nargs="+", default=None, metavar="CONFIG",
                   help="a backend priced by its name (ddp, fsdp, fsdp2, ...), or fsdp_configs/ and ds_configs/ files "
                        "(default: all shipped)")
    p.add_argument("--counted", action="store_true",
                   help="count each configuration's real collectives at each W by running it as rank 0 under "
                        "torch's fake process group (simulation/fake_world.py), instead of its theory: one short "
                        "run per configuration and W on this machine (about a minute each for the paper preset "
                        "on 2 CPU cores); the figure stays on theory")
    p.add_argument("--out", default=None, metavar="DIR", help="directory for projection.md and samples_vs_gpus.png")
    p.add_argument("--json", action="store_true", help="print one JSON object (the GPU, network, assumptions and "
                   "every configuration's row at each W) instead of the tables")
    return p


def check_args(p: OneLineParser, args, hw: dict) -> int:
    """The projection's flags checked (p.error: one line, exit 2); the GPUs per node."""
    if args.gpu == HERE:
        args.gpu = gpu_here(hw) or p.error(
            "--gpu here: this machine has no GPU that analysis/hardware.yaml lists, and the projection is to W of "
            f"them: name one ({', '.join(hw['gpus'])})")
    by_name = [name for name in BACKEND_NAMES if get_backend(name).projected_by_name]
    for c in args.configs or []:
        if c not in by_name and not (c.endswith((".yaml", ".json")) and (REPO / c).is_file()):
            p.error(f"--configs {c}: must be {', '.join(by_name)}, or an existing fsdp_configs/*.yaml or "
                    "ds_configs/*.json file (relative to the repository)")
    for flag, values in (("--world", args.world), ("--configs", args.configs or [])):
        twice = next((v for v in values if values.count(v) > 1), None)
        if twice is not None:
            p.error(f"{flag}: each at most once ({twice} is given {values.count(twice)} times)")
    if args.out:
        try:
            writable_out("--out", args.out)
        except ConfigError as e:
            p.error(str(e))
    if not 0 < args.mfu <= 1 or not 0 <= args.overlap <= 1:
        p.error("--mfu must be in (0, 1], --overlap in [0, 1]")
    if args.gpus_per_node is not None:
        if args.gpus_per_node < 1:
            p.error(f"--gpus_per_node must be >= 1 (got {args.gpus_per_node})")
        hw["gpus"][args.gpu] = {**hw["gpus"][args.gpu], "gpus_per_node": args.gpus_per_node}
    per_node = hw["gpus"][args.gpu]["gpus_per_node"]
    if any(w < 1 or (w > per_node and w % per_node) for w in args.world):
        p.error(f"--world: each must be >= 1 and, beyond one node, whole nodes of {per_node}")
    return per_node


def read_run(args, train_argv: list[str]):
    """The run's flags (train.py's RunConfig) and every configuration file read before any work: a bad
    one is refused in one line."""
    given = config_from_argv(train_argv)
    defaults = config_from_argv([])
    for name in CONFIG_FLAGS:
        if getattr(given, name) != getattr(defaults, name):
            raise ConfigError(f"--{name}: the projection compares configurations; name them with --configs")
    if given.device not in ("auto", "cuda"):
        raise ConfigError(f"--device {given.device}: the projection is of GPUs (--gpu)")
    for c in args.configs or configurations():
        if c.endswith(".json"):
            deepspeed_config.read(str(REPO / c))
        elif c.endswith(".yaml"):
            fsdp_config.load(str(REPO / c))
    return given


def report_lines(result, given, args, a: Assumptions, train_argv: list[str], per_node: int, bytes_from: str,
                 what: str) -> list[str]:
    """The projection's tables by W, and the article's 8-GPU order beside them where it applies."""
    lines = [f"{what} on {args.gpu} x W ({per_node} to a node) over {args.network}; the run: train.py {' '.join(train_argv) or '(defaults)'}",
             f"assumptions: MFU {a.mfu}, overlap {a.overlap}, CPU Adam {a.cpu_adam_gparams_s} G params/s per GPU, "
             "datasheet bandwidths and the precision's peak (analysis/hardware.yaml)", f"bytes and calls: {bytes_from}", ""]
    for w, group in result.groupby("gpus"):
        ranked = group.sort_values("samples/s", ascending=False)
        lines += [f"W = {w}:", ranked.to_string(index=False, float_format=lambda v: f"{v:,.3g}"), ""]
    article = given.model == "gptlite" and given.preset == "paper" and set(result["micro x accum"]) == {"1x1"}
    if article and 8 in args.world and set(ARTICLE) <= set(result["config"]):
        eight = result[result["gpus"] == 8].set_index("config")
        lines += ["the article's 8-GPU measurements (micro-batch 1) beside this projection's order:"]
        order = sorted(ARTICLE, key=lambda c: -ARTICLE[c])
        for c in order:
            lines.append(f"  {c:<24} article {ARTICLE[c]:6.2f} samples/s   projected {eight.loc[c, 'samples/s']:8.1f}")
        projected = sorted(ARTICLE, key=lambda c: -eight.loc[c, "samples/s"])
        lines.append(f"  same order: {projected == order} (projected: {', '.join(projected)})")
    return lines


def main(argv=None) -> int:
    hw = yaml.safe_load(HARDWARE.read_text())
    p = build_parser(hw)
    refuse_renamed(p, argv)
    args, train_argv = p.parse_known_args(argv)
    per_node = check_args(p, args, hw)
    a = Assumptions(mfu=args.mfu, overlap=args.overlap)
    try:
        given = read_run(args, train_argv)
        result = table(train_argv, args.world, args.gpu, args.network, a, args.configs, args.counted, per_node)
    except (ConfigError, DataError) as e:
        p.error(str(e))
    except RuntimeError as e:
        print(f"python -m analysis.project: {e}", file=sys.stderr)
        return 1
    bytes_from = ("counted: each backend's real collectives at W under the fake process group; memory peak "
                  "as measured there on this machine's device" if args.counted else
                  f"each backend's theory (comm_theory), cut into the configuration's buckets where it names "
                  f"them, else {a.bucket_mib} MiB")
    what = f"{given.preset} preset" if given.model == "gptlite" else given.model
    text = "\n".join(report_lines(result, given, args, a, train_argv, per_node, bytes_from, what))
    if args.json:
        print(json.dumps({"gpu": args.gpu, "network": args.network, "train_argv": train_argv, "bytes": bytes_from,
                          "assumptions": dataclasses.asdict(a), "rows": json.loads(result.to_json(orient="records"))}))
    else:
        print(text)
    if args.out:
        _write(Path(args.out), text, args, a, train_argv, what)
    return 0


def _write(out: Path, text: str, args, a: Assumptions, train_argv: list[str], what: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    out.mkdir(parents=True, exist_ok=True)
    curve = table(train_argv, [8, 16, 32, 64, 128, 256, 512, 1024], args.gpu, args.network, a, args.configs,
                  gpus_per_node=args.gpus_per_node)  # theory's bytes: counting 1024 ranks is not what this figure is for
    fig, ax = plt.subplots(figsize=(9, 5))
    sns.lineplot(curve, x="gpus", y="samples/s", hue="config", marker="o", ax=ax)
    ax.set(xscale="log", yscale="log", xlabel="GPUs", title=f"Projected samples/s, {what}, {args.gpu}")
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(out / "samples_vs_gpus.png", dpi=110)
    plt.close(fig)
    (out / "projection.md").write_text(f"```\n{text}\n```\n\n![samples/s against GPUs](samples_vs_gpus.png)\n")


if __name__ == "__main__":
    sys.exit(main())
