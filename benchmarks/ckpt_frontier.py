#!/usr/bin/env python
"""Checkpointing by memory budget against the hand-set policies: for each model and backend, five
`--ckpt_policy auto` budgets between full checkpointing's estimated peak and no checkpointing's,
and the hand-set policies (none, full every k, selective every k), each a real train.py run.

    python benchmarks/ckpt_frontier.py                                   # GPT-lite small and an HF Llama,
                                                                         # single, ddp, fsdp2, ZeRO-3
    python benchmarks/ckpt_frontier.py --models gptlite --backends single --runs_dir /tmp/frontier

Every run goes through its real launcher (python, torchrun, deepspeed; 2 ranks but single) and its
record gives the measured peak per rank (the memory profile's, on CPU) and samples/s. The budgets
come from the estimator on the run's own `train.py --dry_run` record (analysis.estimate), at 0,
1/4, 1/2, 3/4 and all of the way from full checkpointing's estimated peak to none's. Per budget,
the table gives the plan, the estimated and measured peaks, the measured peak over the budget
(issue 22 allows the estimator's band, 10%), the plan's samples/s and those of the fastest
hand-set policy whose measured peak fits the budget. Peaks should fall as budgets fall.

The table is analysis.tables.budget_table, as in `python -m analysis.report` of the same records,
which also draws memory against samples/s with the frontier. A benchmark, not a test: run it on
an otherwise idle machine; the step times of one run are noisy on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.launch import launch_command, launcher_for  # noqa: E402

GiB = 2**30
MODELS = {
    "gptlite": ["--preset", "small"],
    "llama": ["--model", "hf:llama", "--model_args", "num_hidden_layers=6,hidden_size=192,num_attention_heads=6,"
              "num_key_value_heads=6,intermediate_size=512", "--preset", "small"],
}
BACKENDS = {"single": ["--backend", "single"], "ddp": ["--backend", "ddp"],
            "fsdp2": ["--fsdp_config", "fsdp_configs/fsdp2.yaml"], "z3": ["--deepspeed_config", "ds_configs/z3.json"]}
HAND_SET = {"none": [], **{f"full/{k}": ["--ckpt_interval", str(k)] for k in (1, 2, 4)},
            **{f"selective/{k}": ["--ckpt_interval", str(k), "--ckpt_policy", "selective"] for k in (1, 2)}}
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def backend_name(flags: list[str]) -> str:
    return "deepspeed" if "--deepspeed_config" in flags else ("fsdp2" if "--fsdp_config" in flags else flags[1])


def budgets(common: list[str], backend: list[str]) -> list[float]:
    """Five budgets (GiB) from full checkpointing's estimated peak to none's, for this configuration."""
    from analysis.estimate import estimate, record_arguments

    dry = subprocess.run([sys.executable, str(REPO / "train.py"), *common, *backend, "--dry_run"], cwd=REPO,
                         capture_output=True, text=True, check=True)
    config = json.loads(dry.stdout)
    config["world_size"] = 1 if backend_name(backend) == "single" else 2
    model, args, kwargs = record_arguments(config)
    none, full = (estimate(model, *args[:4], k, *args[5:], **kwargs).total_bytes for k in (0, 1))
    return [math.ceil((full + (none - full) * f) / GiB * 1e4) / 1e4 for f in FRACTIONS]  # up: full's peak fits


def run(name: str, flags: list[str], backend: list[str], runs: Path) -> str:
    """One train.py run through its real launcher; its status, or the line that refused it."""
    launcher = launcher_for(backend_name(backend))
    world = 1 if launcher == "python" else 2
    cmd = [*launch_command(launcher, world), *flags, *backend, "--runs_dir", str(runs), "--run_name", name, "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    summary = runs / name / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text())["status"]
    said = [line for line in proc.stderr.splitlines() if "error:" in line]
    return "refused: " + (said[-1].strip() if said else proc.stderr.strip()[-300:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs_dir", default=None, help="where the records go (default: runs/ckpt_frontier-<time>, new)")
    args = p.parse_args()
    runs = Path(args.runs_dir or REPO / "runs" / f"ckpt_frontier-{time.strftime('%Y%m%d-%H%M%S')}")
    for model in args.models.split(","):
        for backend in args.backends.split(","):
            common = [*MODELS[model], "--micro_batch", str(args.micro_batch), "--steps", str(args.steps),
                      "--warmup_steps", str(args.warmup), "--mem_profile_steps", "1", "--eval_batches", "1",
                      "--precision", "fp32"]
            cases = dict(HAND_SET)
            cases.update({f"auto {b:g}": ["--ckpt_policy", "auto", "--mem_budget_gb", str(b)]
                          for b in budgets(common, BACKENDS[backend])})
            for case, flags in cases.items():
                name = f"{model}-{backend}-{case.replace(' ', '-').replace('/', '-')}"
                print(f"{model} {backend} {case}: {run(name, [*common, *flags], BACKENDS[backend], runs)}",
                      file=sys.stderr, flush=True)
    from analysis import load_runs, tables
    from analysis.report import with_estimates

    print(tables.markdown(tables.budget_table(with_estimates(load_runs(runs)))))
    print(f"records: {runs} (python -m analysis.report {runs} --out DIR draws the frontier)")


if __name__ == "__main__":
    main()
