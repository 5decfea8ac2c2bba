#!/usr/bin/env python
"""What a checkpoint's signed manifest costs (training/manifest.py), beside loading it.

    python train.py --preset paper --steps 1 --save_every 1 --micro_batch 1 --save_dir /tmp/paper --run_name p
    python benchmarks/manifest_cost.py /tmp/paper/step_00000000

Times, best of 3: signing the checkpoint (what a save adds: every file hashed once), the first
rank's check before a resume or an export (every file hashed again), another rank's check on the same
machine (signature, sizes, and the first rank's note), and torch.load of its largest file for scale.
The checkpoint's manifest is rewritten (the same one, under your key). A benchmark, not a test: run it
on an idle machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from training import manifest  # noqa: E402


def best_of(f, n: int = 3) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory (step_NNNNNNNN) written by train.py")
    step = parser.parse_args(argv).checkpoint
    files = [p for p in step.rglob("*") if p.is_file() and p.name != manifest.MANIFEST]
    size = sum(p.stat().st_size for p in files)
    sign = best_of(lambda: manifest.write(step))
    first = best_of(lambda: [manifest.file_digest(p) for p in files])  # what the first rank's check hashes
    manifest.verify(step, "checkpoint")  # noted for this machine's other ranks
    other = best_of(lambda: manifest.verify(step, "checkpoint"))
    largest = max(files, key=lambda p: p.stat().st_size)  # verified above: loaded as the backend loads it
    load = best_of(lambda: torch.load(largest, map_location="cpu", weights_only=False))
    print(f"{step}: {len(files)} files, {size / 2**20:.0f} MiB")
    print(f"  sign (at save)          {sign:8.3f} s  ({size / 2**20 / sign:.0f} MiB/s)")
    print(f"  first rank's check      {first:8.3f} s")
    print(f"  another rank's check    {other * 1000:8.1f} ms")
    print(f"  torch.load {largest.name} {load:8.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
