#!/usr/bin/env python
"""The harness's overhead: `train.py --backend single` against a bare hand-written loop.

    python benchmarks/overhead.py                       # small preset, 3 alternating pairs
    python benchmarks/overhead.py --preset tiny --repeats 5

Both sides train the same model (gptlite.model.build_model), on the same batches (gptlite.data),
with the same optimizer (torch AdamW, the suite's constants), warm-up schedule and gradient
clipping, fp32, on the CPU or the GPU, each in a fresh process. The bare loop is the least a user
would write: forward, backward, clip, step, zero_grad, with a synchronising `.item()` of the loss
once per step as any logging loop has. The two alternate (bare, train.py, bare, ...) so that drift
of a shared machine hits both; the ratio of the medians of their samples/s is printed last.

On the CPU the ratio also moves with glibc's allocator: freed tensor memory given back to the
system and faulted in again next step (tens of thousands of page faults a step, depending on the
heap's history rather than on the code that runs). train.py pins glibc's mmap and trim thresholds
itself at start-up (core/allocator.py) unless the environment sets them. So each pair runs twice:
"as users run them" (no environment variable: the bare loop on glibc's defaults, train.py with
its own pinning), the figure the suite is held to; and "both pinned" (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ at 1 GiB in the environment of both), which takes the allocator out of the
comparison and leaves the harness's own cost.

A benchmark, not a test: run it on an otherwise idle machine. Goal: a ratio of at least 0.98.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from backends import REFERENCE  # noqa: E402 (the one process whose harness overhead this measures)
from gptlite.data import BatchLayout, CharDataset  # noqa: E402
from gptlite.model import build_model, preset as model_preset  # noqa: E402


def bare(preset: str, micro_batch: int, steps: int, warmup: int, seed: int) -> float:
    """samples/s of the bare loop: median over the steps after `warmup`."""
    data = CharDataset.load(None, model_preset(preset).block_size)
    cfg = model_preset(preset, vocab_size=data.vocab_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed * 1000)
    model = build_model(cfg, seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, max(0, s - 1) / 20))
    layout = BatchLayout(micro_batch, 1, 1, 0)
    rates = []
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x, y in layout.micro_batches(data, "train", seed, step):
            _, loss = model(x.to(device), y.to(device))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            rates.append(micro_batch / (time.perf_counter() - t0))
    return statistics.median(rates)


PINNED = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def harness(preset: str, micro_batch: int, steps: int, warmup: int, seed: int, env: dict) -> float:
    """samples/s that train.py records for the same work (its median over the timed steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(REPO / "train.py"), "--backend", REFERENCE, "--preset", preset, "--micro_batch",
               str(micro_batch), "--steps", str(steps), "--warmup_steps", str(warmup), "--mem_profile_steps", "0",
               "--eval_batches", "1", "--seed", str(seed), "--runs_dir", tmp, "--run_name", "overhead", "--quiet"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"train.py failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return json.loads((Path(tmp) / "overhead" / "summary.json").read_text())["samples_per_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=("tiny", "small", "paper"))
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of each median")
    p.add_argument("--repeats", type=int, default=3, help="alternating pairs (bare, train.py)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--bare_only", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = p.parse_args(argv)
    work = (args.preset, args.micro_batch, args.steps, args.warmup, args.seed)
    if args.bare_only:
        print(bare(*work))
        return 0
    for allocator, extra in (("as users run them", {}), ("both pinned", PINNED)):
        env = {k: v for k, v in os.environ.items() if k not in PINNED} | extra
        results = {"bare": [], "train.py": []}
        for i in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--bare_only", "--preset", args.preset, "--micro_batch",
                                  str(args.micro_batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                                  "--seed", str(args.seed)], capture_output=True, text=True, check=True, env=env)
            results["bare"].append(float(out.stdout.strip().splitlines()[-1]))
            results["train.py"].append(harness(*work, env))
            print(f"{allocator}, pair {i + 1}: bare {results['bare'][-1]:.2f} samples/s, train.py "
                  f"{results['train.py'][-1]:.2f} samples/s", flush=True)
        ratio = statistics.median(results["train.py"]) / statistics.median(results["bare"])
        print(f"{args.preset} preset, micro-batch {args.micro_batch}, {args.steps} steps ({args.warmup} warm-up), "
              f"{args.repeats} pairs, allocator {allocator}: train.py / bare samples/s = {ratio:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
