"""Rank 0 of a W-rank world, in this one process: its real collectives and memory, no cluster.

    python -m simulation.fake_world --world 64 --gpus_per_node 8 -- --preset paper --deepspeed_config ds_configs/z3.json
    python -m simulation.fake_world --world 2 --out results -- --preset tiny --fsdp_config fsdp_configs/fsdp2.yaml

torch's fake process group (torch.testing._internal.distributed.fake_pg) answers every collective
at once without moving a byte, so one process runs the backend exactly as rank 0 of W ranks would:
the same sharding, the same buckets, the same collectives with the same shapes (counted by the
profiled step as in any run, core/comm.py), the same tensors alive (the memory peak, measured as in
any run, core/memory_profile.py). What the collectives would have carried is missing, so the
losses are meaningless and nothing else of the run is kept: the record goes to a temporary
directory and the result is the step's communication and memory, printed and, with --out DIR,
written as JSON to DIR/fake_world.json. Checked against real 2-rank runs of every backend it runs (tests/unit/test_fake_world.py):
the same bytes, and the memory peak within 10%.

Every train.py flag applies (after `--`) except those saying where to write (records, checkpoints,
NVMe swap files); by default the run is 2 steps (the second profiled), with one validation batch.
Memory grows with the simulated world (PER_RANK_PER_BLOCK below): a world this machine cannot
hold, like an unwritable --out, is refused before the simulation starts. The backend runs on this machine's device: on a GPU, its memory is that of a
rank of the simulated world.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import backends
from core.blocks import find_blocks
from core.config import RunConfig
from estimator.estimate import estimate_from_record
from gptlite.errors import ConfigError
from simulation.describe import resolve_flags
from training.cli import OneLineParser, config_from_argv, parse_args
from training.preflight import writable_out
from training.run import check_model
from training.run import main as run

OUT_FILE = "fake_world.json"  # what --out DIR holds
# Short by default: the first step settles the allocations, the second (the last) is profiled.
DEFAULT_FLAGS = ("--steps", "2", "--warmup_steps", "1", "--eval_batches", "1", "--quiet")
# Every train.py setting that makes a run write where the user says (records, checkpoints, NVMe swap
# files, which DeepSpeed clears at start): a simulated run writes only into its own temporary
# directory. Checked on the resolved flags, so no spelling of them gets past.
OUTPUT_FIELDS = ("runs_dir", "run_name", "overwrite", "resume", "save_dir", "save_every", "keep_checkpoints",
                 "nvme_path")


def check_train_flags(train_argv: list[str]):
    """train.py's flags as train.py reads them (their RunConfig), none of them saying where to write
    (ConfigError)."""
    cfg = config_from_argv([*DEFAULT_FLAGS, *train_argv])
    for f in fields(RunConfig):
        if f.name in OUTPUT_FIELDS and getattr(cfg, f.name) != f.default:
            raise ConfigError(f"--{f.name}: a simulated run keeps no record or checkpoint and writes only into a "
                              "temporary directory of its own (its losses are meaningless)")
    return cfg


# Memory grows linearly with --world: for every collective of the profiled step the fake process
# group and the profiler keep lists of the world's ranks (and ZeRO-3 keeps per-rank partition
# bookkeeping), and the collectives grow with the model's blocks. Measured here (peak RSS at W =
# 2000 to 10000, CPU), per simulated rank: DDP 27 KiB (tiny preset, 4 blocks), FSDP 300 (tiny) and
# 420 (small, 6 blocks), FSDP2 275, ZeRO-2 114, ZeRO-3 2500 (tiny) and 3950 (small). Bytes per
# simulated rank and per block (plus one for the rest of the model), above every measurement, by the
# family a backend says it grows like (Backend.fake_world_growth): a replica (DDP), sharded blocks (FSDP,
# FSDP2), ZeRO 0-2, ZeRO-3:
PER_RANK_PER_BLOCK = {"replica": 8 * 2**10, "sharded_blocks": 64 * 2**10, "zero": 32 * 2**10,
                      "zero3": 640 * 2**10}
BASE_BYTES = 2**30  # the process itself: libraries, the model, the step


def world_memory(world: int, cfg) -> tuple[int, str]:
    """Bytes rank 0 needs to simulate `world` ranks of the run `cfg`, and what that comes from."""
    family, what = backends.get_backend(backends.named_by(cfg)).fake_world_growth(cfg)
    workload = check_model(cfg)
    blocks = len(find_blocks(workload.meta(), cfg.block_class))  # 0 for a model without any (ddp, ZeRO)
    per_rank = PER_RANK_PER_BLOCK[family] * (blocks + 1)
    return BASE_BYTES + world * per_rank, f"{per_rank / 2**10:.0f} KiB per simulated rank for {what} with {blocks} blocks"


def available_memory() -> int | None:
    """The memory the kernel says can be had without swapping (Linux), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def step_memory(world: int, gpus_per_node: int, train_argv: list[str]) -> int:
    """The estimator's peak for the simulated rank's own step (estimator/estimate.py): its model states at
    this world and its activations, which the real step it runs on this machine holds. The paper preset
    at micro-batch 8, ZeRO-3 at world 64: 64.9 GiB estimated, and the simulation was killed by the kernel
    at 23.6 GiB on a 23 GiB machine before this was counted (2026-12-05)."""
    setup = resolve_flags(train_argv, world, gpus_per_node)
    return estimate_from_record({**setup.record(), "environment": {"device": "cpu"}}).total_bytes


def check_world(world: int, cfg, gpus_per_node: int = 8, train_argv: list[str] | None = None) -> None:
    """Refuse (ConfigError) a world this machine cannot simulate, before simulating it: the per-rank
    bookkeeping of `world` ranks, and (given `train_argv`) the simulated rank's own step."""
    available = available_memory()
    if available is None:
        return
    need, why = world_memory(world, cfg)
    step = step_memory(world, gpus_per_node, train_argv) if train_argv is not None else 0
    if step + BASE_BYTES > available:
        raise ConfigError(f"--world {world}: the simulated rank's own step needs about {step / 2**30:.1f} GiB (the "
                          f"estimator's peak: its activations and its share of the model states) and "
                          f"{available / 2**30:.1f} GiB is available: ask for a smaller micro-batch or model")
    if need + step > available:
        per_rank = (need - BASE_BYTES) / world
        limit = max(0, int((available - BASE_BYTES - step) // per_rank))
        raise ConfigError(f"--world {world}: simulating it needs about {(need + step) / 2**30:.1f} GiB of memory "
                          f"({why}: every collective of the profiled step keeps a list of the world's ranks; and "
                          f"{step / 2**30:.1f} GiB for the step itself) and {available / 2**30:.1f} GiB is available: "
                          f"at most --world {limit} here")


def simulate(world: int, gpus_per_node: int, train_argv: list[str]) -> dict:
    """Run train.py's flags as rank 0 of `world` ranks (nodes of `gpus_per_node`): what the run
    recorded (its step's collectives, memory, status), or only train.py's exit code where it refused
    the flags before making a record (it has said why)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(min(world, gpus_per_node)), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    with tempfile.TemporaryDirectory(prefix="fake_world-") as runs_dir:
        cfg = parse_args([*DEFAULT_FLAGS, *train_argv, "--runs_dir", runs_dir, "--run_name", "fake_world"])
        swap_flag = backends.get_backend(backends.named_by(cfg)).swap_flag
        if swap_flag:
            # NVMe offload's swap files go to a directory of its own, never the one its config names.
            nvme = Path(runs_dir) / "nvme"
            nvme.mkdir()
            cfg = dataclasses.replace(cfg, **{swap_flag: str(nvme)})
        # Initialised before the run starts, the fake group is the one the backend finds and uses.
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        code = run(cfg)
        record = Path(runs_dir) / "fake_world"
        summary = json.loads((record / "summary.json").read_text()) if (record / "summary.json").exists() else None
        config = json.loads((record / "config.json").read_text()) if (record / "config.json").exists() else None
    if summary is None:  # refused before a record was made; train.py has said why
        return {"exit_code": code}
    return {"exit_code": code, "world_size": world, "gpus_per_node": gpus_per_node, "status": summary["status"],
            "error": summary.get("error"), "run": config["run"] if config else None,
            "plan": config.get("plan") if config else None,
            "comm": summary.get("comm"), "mem_peak_bytes": summary.get("mem_peak_bytes"),
            "mem_breakdown": summary.get("mem_breakdown"), "model_state_bytes": summary.get("model_state_bytes")}


def describe(result: dict) -> str:
    comm = result["comm"] or {}
    lines = [f"rank 0 of {result['world_size']} ({result['gpus_per_node']} per node), fake process group: "
             f"{result['status']}"]
    for kind, v in sorted(comm.get("collectives", {}).items()):
        lines.append(f"  {kind:<15} {v['calls']:5d} calls  {v['bytes'] / 2**20:10.3f} MiB  "
                     f"bus {v['bus_bytes'] / 2**20:10.3f} MiB")
    if comm:
        lines.append(f"  total bus {comm['bus_bytes'] / 2**20:.3f} MiB, theory {comm['theory']['bus_bytes'] / 2**20:.3f} "
                     f"MiB ({comm['theory']['formula']})")
    if result["mem_peak_bytes"] is not None:
        lines.append(f"  memory peak {result['mem_peak_bytes'] / 2**20:.1f} MiB (live tensors, profiled step)")
    return "\n".join(lines)


@contextlib.contextmanager
def _stdout_to_stderr():
    """What is printed meanwhile (Python's prints and the libraries' handlers on file descriptor 1)
    goes to stderr: stdout keeps only the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = OneLineParser(prog="python -m simulation.fake_world", description=__doc__.splitlines()[0],
                      epilog="\n".join(__doc__.splitlines()[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, required=True, help="ranks in the simulated world")
    p.add_argument("--gpus_per_node", type=int, default=8, help="ranks per node (HYBRID_SHARD's shard groups)")
    p.add_argument("--out", default=None, metavar="DIR", help=f"also write the result as JSON to DIR/{OUT_FILE}")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (what --out writes) "
                   "instead of its summary; what the run prints goes to stderr")
    args = p.parse_args(own)
    if args.world < 1 or args.gpus_per_node < 1:
        p.error("--world and --gpus_per_node must be >= 1")
    if args.world > args.gpus_per_node and args.world % args.gpus_per_node:
        p.error(f"--world {args.world}: beyond one node, whole nodes of --gpus_per_node {args.gpus_per_node}")
    try:  # all before simulating: a simulation can take minutes
        cfg = check_train_flags(train_argv)
        if args.out:
            writable_out("--out", args.out, writes=OUT_FILE)
        check_world(args.world, cfg, args.gpus_per_node, train_argv)
    except ConfigError as e:
        p.error(str(e))
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        result = simulate(args.world, args.gpus_per_node, train_argv)
    if "status" not in result:
        return result["exit_code"]
    print(json.dumps(result) if args.json else describe(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / OUT_FILE).write_text(json.dumps(result, indent=2))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
