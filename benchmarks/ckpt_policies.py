#!/usr/bin/env python
"""What each checkpointing policy frees and costs: no checkpointing, full and selective
(`--ckpt_policy`), every block checkpointed, one process.

    python benchmarks/ckpt_policies.py                          # GPT-lite small, 3 rounds
    python benchmarks/ckpt_policies.py --model hf:llama --model_args \\
        hidden_size=192,intermediate_size=512,num_hidden_layers=6,num_attention_heads=6,num_key_value_heads=6

Each run is `train.py --backend single` in a fresh process. Its record gives the activation bytes
at the peak (mem_breakdown.activation, from the profiled last step) and samples/s (the median of
the timed steps before it). The policies alternate (none, full, selective, none, ...) so that drift
of a shared machine hits each; the table gives the medians over the rounds:
- activation bytes at the peak, and their ratio to no checkpointing;
- the step time, and its cost over no checkpointing (step time / none's - 1);
- selective's cost as a share of full's.

A benchmark, not a test: run it on an otherwise idle machine. Issue 22's goal for selective:
activation bytes <= 0.5 of none's, and a cost at most half of full's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from backends import REFERENCE  # noqa: E402 (the one process these policies are timed in)
POLICIES = {"none": [], "full": ["--ckpt_interval", "1"],
            "selective": ["--ckpt_interval", "1", "--ckpt_policy", "selective"]}


def run(policy: str, args, runs: Path, k: int) -> dict:
    name = f"{policy.split(':')[0] + ('-custom' if ':' in policy else '')}-{k}"  # a run name, not the op list
    cmd = [sys.executable, str(REPO / "train.py"), "--backend", REFERENCE, "--model", args.model,
           "--preset", args.preset, "--micro_batch", str(args.micro_batch), "--steps", str(args.steps),
           "--warmup_steps", str(args.warmup), "--mem_profile_steps", "1", "--eval_batches", "1",
           "--dropout", str(args.dropout), "--runs_dir", str(runs), "--run_name", name, "--quiet",
           *(["--model_args", args.model_args] if args.model_args else []),
           *(["--attention", args.attention] if args.attention else []), *POLICIES[policy]]
    subprocess.run(cmd, cwd=REPO, check=True)
    summary = json.loads((runs / name / "summary.json").read_text())
    if summary["status"] != "ok":
        raise SystemExit(f"{name}: {summary['status']}: {summary['error']}")
    return {"activation": summary["mem_breakdown"]["activation"], "peak": summary["mem_peak_bytes"],
            "step_s": args.micro_batch / summary["samples_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="gptlite")
    p.add_argument("--model_args", default=None)
    p.add_argument("--preset", default="small", help="GPT-lite's size; the context length of hf: text models")
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--attention", default=None, help="GPT-lite's --attention (naive, sdpa); default the model's "
                   "(HF models take theirs from --model_args)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--save_ops", default=None,
                   help="also measure selective keeping these ops (--ckpt_save_ops), as policy 'selective:OPS'")
    args = p.parse_args()
    if args.save_ops:
        POLICIES[f"selective:{args.save_ops}"] = [*POLICIES["selective"], "--ckpt_save_ops", args.save_ops]
    got: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    with tempfile.TemporaryDirectory(prefix="ckpt-policies-") as tmp:
        for k in range(args.rounds):
            for policy in POLICIES:
                got[policy].append(run(policy, args, Path(tmp), k))
                print(f"round {k + 1}/{args.rounds} {policy}: {got[policy][-1]}", file=sys.stderr, flush=True)
    med = {policy: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for policy, rows in got.items()}
    none = med["none"]
    cost = {policy: m["step_s"] / none["step_s"] - 1 for policy, m in med.items()}
    print(f"{args.model} {args.model_args or args.preset}, attention {args.attention or 'default'}, dropout "
          f"{args.dropout:g}, micro-batch {args.micro_batch}, every block, median of {args.rounds}")
    print("| policy | activation MiB at peak | vs none | peak MiB | step ms | cost over none | share of full's cost |")
    print("|---|---|---|---|---|---|---|")
    for policy, m in med.items():
        share = f"{cost[policy] / cost['full']:.2f}" if policy != "none" and cost["full"] > 0 else ""
        print(f"| {policy} | {m['activation'] / 2**20:.1f} | {m['activation'] / none['activation']:.2f} | "
              f"{m['peak'] / 2**20:.1f} | {m['step_s'] * 1e3:.1f} | {cost[policy]:+.1%} | {share} |")
    spread = {policy: [r["step_s"] * 1e3 for r in rows] for policy, rows in got.items()}
    print("step ms per round: " + "; ".join(f"{p}: {', '.join(f'{v:.1f}' for v in vals)}" for p, vals in spread.items()))


if __name__ == "__main__":
    main()
