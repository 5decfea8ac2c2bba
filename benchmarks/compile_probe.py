#!/usr/bin/env python
"""torch.compile against eager on one GPU: a bare training loop of GPT-lite, samples/s and MFU.

    python benchmarks/compile_probe.py --preset paper --micro_batch 32

A benchmark, not a test: it times; it asserts nothing. It runs eager, compiled, eager again (the
two eager runs give the spread), each on its own freshly built model with torch's AdamW (the
suite's constants) under bf16 autocast, and prints one line per run. The first step of the
compiled run includes compilation. MFU: model FLOPs (core/flops.py) over the device's dense
bf16 peak. This is how docs/compile.md's figure for the H100 was measured; `--compile` inside
train.py is the compiled-training issue's work.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gptlite.model import build_model, preset  # noqa: E402
from core.flops import peak_flops  # noqa: E402


def run(cfg, compiled: bool, micro_batch: int, steps: int, warmup: int, device: str) -> str:
    model = build_model(cfg, 0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    forward = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size), generator=g).to(device)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    timed = sorted(times[warmup:])
    median = timed[len(timed) // 2]
    rate = micro_batch / median
    peak = peak_flops(torch.cuda.get_device_name())
    mfu = rate * cfg.block_size * cfg.flops_per_token / peak if peak else float("nan")
    return (f"compiled={compiled} mb={micro_batch} first_step_s={times[0]:.2f} median_step_s={median:.4f} "
            f"samples_per_s={rate:.1f} MFU={mfu:.3f} loss={loss.item():.4f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="paper")
    p.add_argument("--micro_batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the median")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("compile_probe: error: needs a CUDA device", file=sys.stderr)
        return 2
    cfg = preset(args.preset, attention="sdpa", vocab_size=65)
    for compiled in (False, True, False):
        print(run(cfg, compiled, args.micro_batch, args.steps, args.warmup, "cuda"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
