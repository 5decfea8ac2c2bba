#!/usr/bin/env python
"""Checkpointing by memory budget against the hand-set policies: for each model and backend, five
`--ckpt_policy auto` budgets between full checkpointing's estimated peak and no checkpointing's,
and the hand-set policies (none, full every k, selective every k), each a real train.py run.

    python benchmarks/ckpt_frontier.py                                   # GPT-lite small and an HF Llama,
                                                                         # single, ddp, fsdp2, ZeRO-3
    python benchmarks/ckpt_frontier.py --models gptlite --backends single --runs_dir /tmp/frontier

Every run goes through its real launcher (python, torchrun, deepspeed; 2 ranks but single) and its
record gives the measured peak per rank (the memory profile's, on CPU) and samples/s. The budgets
come from the estimator on the run's own `train.py --dry_run` record (analysis.estimate_cli), at 5%,
27.5%, 50%, 72.5% and 95% of the way from full checkpointing's estimated peak to none's. Per budget,
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

import pandas as pd  # noqa: E402

from analysis import load_runs, tables  # noqa: E402
from analysis.report import with_estimates  # noqa: E402
from estimator.estimate import estimate, record_arguments  # noqa: E402
from backends import DDP, FSDP2, REFERENCE, get_backend  # noqa: E402
from orchestration.launch import launch_command, launcher_for  # noqa: E402
from orchestration.sweep import backend_of  # noqa: E402

GiB = 2**30
MODELS = {
    "gptlite": ["--preset", "small"],
    "llama": ["--model", "hf:llama", "--model_args", "num_hidden_layers=6,hidden_size=192,num_attention_heads=6,"
              "num_key_value_heads=6,intermediate_size=512", "--preset", "small"],
}
# The benchmark's sweep spec: each configuration's train.py flags, by a short name.
BACKENDS = {REFERENCE: ["--backend", REFERENCE], DDP: ["--backend", DDP],
            FSDP2: ["--fsdp_config", "fsdp_configs/fsdp2.yaml"], "z3": ["--deepspeed_config", "ds_configs/z3.json"]}
HAND_SET = {"none": [], **{f"full/{k}": ["--ckpt_interval", str(k)] for k in (1, 2, 4)},
            **{f"selective/{k}": ["--ckpt_interval", str(k), "--ckpt_policy", "selective"] for k in (1, 2)}}
# Inside the range, not at its ends: a budget exactly at a policy's estimated peak leaves the plan no room
# for the estimator's error (estimator/checkpointing_plan.py HEADROOM).
FRACTIONS = (0.05, 0.275, 0.5, 0.725, 0.95)


def backend_name(flags: list[str]) -> str:
    """The backend BACKENDS' flags select: a backend's name or its config file, as a sweep's matrix names it."""
    return backend_of(flags[1])[0]


def budgets(common: list[str], backend: list[str]) -> list[float]:
    """Five budgets (GiB) from full checkpointing's estimated peak to none's, for this configuration."""
    dry = subprocess.run([sys.executable, str(REPO / "train.py"), *common, *backend, "--dry_run"], cwd=REPO,
                         capture_output=True, text=True, check=True)
    config = json.loads(dry.stdout)
    config["world_size"] = 1 if get_backend(backend_name(backend)).one_process else 2
    model, args, kwargs = record_arguments(config)
    # With what the estimate leaves unfixed (FSDP on gloo), which a plan keeps free.
    none, full = (sum((e.total_bytes, e.unfixed_bytes)) for e in (estimate(model, *args[:4], k, *args[5:], **kwargs)
                                                                for k in (0, 1)))
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
    p.add_argument("--repeats", type=int, default=1, help="rounds of every run, one round after another "
                   "(the configurations alternate); the summary takes medians")
    p.add_argument("--first_round", type=int, default=0, help="start at this round (0-based) in a --runs_dir that "
                   "holds the earlier ones: rounds may be run in separate sittings; the summary takes every round there")
    p.add_argument("--runs_dir", default=None, help="where the records go (default: runs/ckpt_frontier-<time>, new)")
    args = p.parse_args()
    runs = Path(args.runs_dir or REPO / "runs" / f"ckpt_frontier-{time.strftime('%Y%m%d-%H%M%S')}")
    grid = []
    for model in args.models.split(","):
        for backend in args.backends.split(","):
            common = [*MODELS[model], "--micro_batch", str(args.micro_batch), "--steps", str(args.steps),
                      "--warmup_steps", str(args.warmup), "--mem_profile_steps", "1", "--eval_batches", "1",
                      "--precision", "fp32"]
            cases = dict(HAND_SET)
            cases.update({f"auto {b:g}": ["--ckpt_policy", "auto", "--mem_budget_gb", str(b)]
                          for b in budgets(common, BACKENDS[backend])})
            grid += [(model, backend, case, [*common, *flags]) for case, flags in cases.items()]
    for r in range(args.first_round, args.repeats):
        for model, backend, case, flags in grid:
            name = f"{model}-{backend}-{case.replace(' ', '-').replace('/', '-')}-r{r}"
            print(f"round {r + 1}/{args.repeats}, {model} {backend} {case}: {run(name, flags, BACKENDS[backend], runs)}",
                  file=sys.stderr, flush=True)
    loaded = with_estimates(load_runs(runs))
    if args.repeats == 1:
        print(tables.markdown(tables.budget_table(loaded)))
    else:
        print(tables.markdown(medians(loaded)))
    print(f"records: {runs} (python -m analysis.report {runs} --out DIR draws the frontier)")


def medians(runs):
    """Per model, backend and budget over the rounds: the auto run's median samples/s and largest
    measured peak, against the hand-set policy with the highest median samples/s whose largest
    measured peak over the rounds fits the budget; the ratio of the medians and its range over rounds
    (each round's auto run against the same round's run of that policy)."""
    runs = runs.assign(case=runs["run_name"].str.replace(r"-r\d+$", "", regex=True),
                       round=runs["run_name"].str.extract(r"-r(\d+)$", expand=False))
    rows = []
    for (model, label), group in runs.groupby(["model", "label"], sort=False):
        ok = group[group["status"] == "ok"]
        hand = ok[ok["config.run.ckpt_policy"] != "auto"].groupby("case").agg(
            sps=("samples_per_s", "median"), peak=("mem_peak_bytes", "max"), n=("run_name", "size"), ckpt=("ckpt", "first"))
        for case, auto in group[group["config.run.ckpt_policy"] == "auto"].groupby("case", sort=False):
            budget = float(auto["config.run.mem_budget_gb"].iloc[0])
            done = auto[auto["status"] == "ok"]
            fits = hand[hand["peak"] <= budget * GiB]
            best = fits["sps"].idxmax() if not fits.empty else None
            row = {"model": model, "config": label, "budget GiB": budget,
                   "statuses": ",".join(sorted(set(auto["status"]))),
                   "plan": done["ckpt"].iloc[0].split(": ", 1)[-1] if not done.empty else None,
                   "estimate MiB": done["estimate.total_bytes"].iloc[0] / 2**20 if not done.empty else None,
                   "peak MiB (max)": done["mem_peak_bytes"].max() / 2**20 if not done.empty else None,
                   "peak / budget": done["mem_peak_bytes"].max() / (budget * GiB) if not done.empty else None,
                   "samples/s (median)": done["samples_per_s"].median() if not done.empty else None,
                   "fastest hand-set that fits": hand.loc[best, "ckpt"] if best else None,
                   "its samples/s (median)": hand.loc[best, "sps"] if best else None}
            if best and not done.empty:
                row["auto / it"] = row["samples/s (median)"] / row["its samples/s (median)"]
                theirs = ok[ok["case"] == best].set_index("round")["samples_per_s"]
                per_round = (done.set_index("round")["samples_per_s"] / theirs).dropna()
                row["range over rounds"] = f"{per_round.min():.2f}-{per_round.max():.2f}"
            rows.append(row)
    return pd.DataFrame(rows)


if __name__ == "__main__":
    main()
