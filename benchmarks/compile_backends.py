#!/usr/bin/env python
"""Compiled against eager training, per backend: samples/s, their ratio, compile seconds, graph breaks.

    python benchmarks/compile_backends.py                       # small preset, 2 CPU ranks
    python benchmarks/compile_backends.py --preset paper --nproc 1 --micro_batch 8 --precision bf16   # one GPU

A benchmark, not a test: it times and asserts nothing. Each backend runs eager, then compiled,
through train.py and its own launcher (as a sweep would), alternating, --repeats times; a run's
samples/s is train.py's median over its timed steps (the first --warmup_steps, where compilation
happens, left out), and the table shows the median over the repeats. Compile seconds, graphs,
graph breaks and recompilations are the compiled runs' records (backends/compile.py). Run it on an
idle machine: anything else running makes the numbers noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from backends import DDP, FSDP, FSDP2, REFERENCE, get_backend  # noqa: E402
from orchestration.launch import REPO, launch_command, launcher_for  # noqa: E402
from orchestration.sweep import backend_of  # noqa: E402

BACKENDS = {  # the benchmark's sweep spec: name -> train.py flags
    REFERENCE: ("--backend", REFERENCE),
    DDP: ("--backend", DDP),
    FSDP: ("--fsdp_config", "fsdp_configs/full_shard.yaml"),
    FSDP2: ("--fsdp_config", "fsdp_configs/fsdp2.yaml"),
    "z1": ("--deepspeed_config", "ds_configs/z1.json"),
    "z3": ("--deepspeed_config", "ds_configs/z3.json"),
}


def run(name: str, compiled: bool, args, runs_dir: Path, index: int) -> dict:
    flags = BACKENDS[name]
    backend = backend_of(flags[1])[0]  # a backend's name or its config file, as a sweep's matrix names it
    nproc = 1 if get_backend(backend).one_process else args.nproc
    run_name = f"{name}-{'compiled' if compiled else 'eager'}-{index}"
    cmd = [*launch_command(launcher_for(backend), nproc), "--runs_dir", str(runs_dir), "--run_name", run_name,
           "--quiet", *flags, "--preset", args.preset, "--micro_batch", str(args.micro_batch), "--precision",
           args.precision, "--steps", str(args.steps), "--warmup_steps", str(args.warmup_steps),
           "--mem_profile_steps", "0", "--eval_batches", "1",
           *(["--compile", "--compile_backend", args.compile_backend] if compiled else [])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    summary_path = runs_dir / run_name / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if proc.returncode != 0 or summary.get("status") != "ok":
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"  {run_name}: failed ({tail})", file=sys.stderr)
        return {}
    print(f"  {run_name}: {summary['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--preset", default="small")
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the distributed backends")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup_steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--compile_backend", default="inductor")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile_bench-") as tmp:
        results = {name: {"eager": [], "compiled": []} for name in args.backends}
        for i in range(args.repeats):
            for name in args.backends:
                for compiled in (False, True):
                    results[name]["compiled" if compiled else "eager"].append(run(name, compiled, args, Path(tmp), i))
        for name, r in results.items():
            eager = [s["samples_per_s"] for s in r["eager"] if s]
            comp = [s for s in r["compiled"] if s]
            if not eager or not comp:
                rows.append(f"| {name} | failed | | | | | |")
                continue
            e, c = statistics.median(eager), statistics.median(s["samples_per_s"] for s in comp)
            stats = comp[0]["compile"]
            rows.append(f"| {name} | {e:.1f} | {c:.1f} | {c / e:.2f} | "
                        f"{statistics.median(s['compile']['compile_s'] for s in comp):.1f} | {stats['graph_breaks']} | "
                        f"{stats['recompiles']} |")
    print(f"{args.preset} preset, micro-batch {args.micro_batch}, {args.precision}, {args.nproc} ranks (single: 1), "
          f"{args.steps} steps ({args.warmup_steps} untimed), {args.compile_backend}, median of {args.repeats}")
    print("| backend | eager samples/s | compiled samples/s | ratio | compile s | graph breaks | recompiles |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
