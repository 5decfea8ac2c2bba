"""Time torch's scaled_dot_product_attention kernels at a model's attention shape (issue 43).

Attention is about a third of the paper preset's step on an H200 (runs/reference/nvidia-h200), and
sdpa picks its kernel by itself (cuDNN's on Hopper with torch 2.11). This times each kernel torch
offers for the shape, forward and backward, with the preset's dropout and without, so `--sdpa_kernel`
can name the fastest:

    python benchmarks/sdpa_kernels.py --preset paper --batch 64 --json sdpa.json

Each kernel: WARM calls, then REPEAT calls timed with CUDA events (on a CPU, the wall clock), the
median kept; a kernel that refuses the shape (or the device) is listed with torch's reason. FLOP/s
counts the work a causal kernel does: half of QK^T and AV forward (4 B H T^2 hs / 2), backward 2.5x
the forward (five matrix products against two).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.sdpa import SDPA_KERNELS, sdpa_backends  # noqa: E402
from gptlite.model import preset  # noqa: E402


def time_kernel(kernel: str, shape: tuple[int, int, int, int], dropout: float, device: str, warm: int,
                repeat: int) -> dict:
    """One kernel's median forward and forward+backward milliseconds at `shape` (B, H, T, hs), bf16."""
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)
    cuda = device.startswith("cuda")

    def clock(fn) -> float:
        for _ in range(warm):
            fn()
        times = []
        for _ in range(repeat):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)

    def both():
        forward().backward(grad)

    try:
        with sdpa_kernel(sdpa_backends(kernel)):
            fwd = clock(forward)
            fwd_bwd = clock(both)
    except RuntimeError as e:  # the kernel refuses this shape, dtype, dropout or device
        return {"kernel": kernel, "dropout": dropout, "error": str(e).splitlines()[0][:200]}
    B, H, T, hs = shape
    flops = 4 * B * H * T * T * hs / 2  # causal forward
    return {"kernel": kernel, "dropout": dropout, "forward_ms": round(fwd, 3), "forward_backward_ms": round(fwd_bwd, 3),
            "forward_tflops": round(flops / fwd / 1e9, 1), "forward_backward_tflops": round(3.5 * flops / fwd_bwd / 1e9, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="paper", help="GPT-lite preset whose attention shape is timed (default paper)")
    p.add_argument("--batch", type=int, default=64, help="micro-batch (default 64)")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    cfg = preset(args.preset)
    shape = (args.batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
    rows = []
    for dropout in sorted({cfg.dropout, 0.0}, reverse=True):
        for kernel in SDPA_KERNELS[1:]:
            row = time_kernel(kernel, shape, dropout, args.device, args.warm, args.repeat)
            rows.append(row)
            if "error" in row:
                print(f"{kernel:10s} dropout {dropout}: refused ({row['error']})", flush=True)
            else:
                print(f"{kernel:10s} dropout {dropout}: forward {row['forward_ms']:8.3f} ms "
                      f"({row['forward_tflops']:6.1f} TFLOP/s), forward+backward {row['forward_backward_ms']:8.3f} ms "
                      f"({row['forward_backward_tflops']:6.1f} TFLOP/s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "device": args.device, "rows": rows}, indent=1) + "\n")


def _cuda() -> bool:
    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
