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
the table gives the plan, the estimated and measured peaks, whether the measured peak is within
the budget plus 10% (the estimator's band), the plan's step time and that of the fastest hand-set
policy whose measured peak fits the budget. Peaks should fall as budgets fall.

A benchmark, not a test: run it on an otherwise idle machine; the step times of one round are
noisy on a shared 2-core machine (`--rounds` repeats the timed runs and takes medians).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
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


def run(name: str, flags: list[str], backend: list[str], runs: Path) -> dict:
    launcher = launcher_for(backend_name(backend))
    world = 1 if launcher == "python" else 2
    cmd = [*launch_command(launcher, world), *flags, *backend, "--runs_dir", str(runs), "--run_name", name,
           "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    summary_path = runs / name / "summary.json"
    if not summary_path.exists():
        said = [line for line in proc.stderr.splitlines() if "error:" in line]
        return {"status": "refused", "error": said[-1].strip() if said else proc.stderr.strip()[-300:]}
    summary = json.loads(summary_path.read_text())
    config = json.loads((runs / name / "config.json").read_text())
    from analysis.estimate import estimate_from_record

    return {"status": summary["status"], "peak": summary.get("mem_peak_bytes"),
            "samples_per_s": summary.get("samples_per_s"), "plan": config["run"].get("ckpt_plan"),
            "estimate": estimate_from_record(config).total_bytes if summary["status"] == "ok" else None,
            "error": summary.get("error")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="timed repeats of every run (medians)")
    p.add_argument("--runs_dir", default=None, help="where the records go (default: runs/ckpt_frontier-<time>, new)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    runs = Path(args.runs_dir or REPO / "runs" / f"ckpt_frontier-{time.strftime('%Y%m%d-%H%M%S')}")
    results = []
    for model in args.models.split(","):
        for backend in args.backends.split(","):
            common = [*MODELS[model], "--micro_batch", str(args.micro_batch), "--steps", str(args.steps),
                      "--warmup_steps", str(args.warmup), "--mem_profile_steps", "1", "--eval_batches", "1",
                      "--precision", "fp32"]
            planned = budgets(common, BACKENDS[backend])
            cases = {name: flags for name, flags in HAND_SET.items()}
            cases.update({f"auto {b:g}": ["--ckpt_policy", "auto", "--mem_budget_gb", str(b)] for b in planned})
            got: dict[str, list[dict]] = {}
            for r in range(args.rounds):
                for case, flags in cases.items():  # alternating: each round runs every case once
                    name = f"{model}-{backend}-{case.replace(' ', '-').replace('/', '-')}-r{r}"
                    got.setdefault(case, []).append(run(name, [*common, *flags], BACKENDS[backend], runs))
                    print(f"{model} {backend} {case}: {got[case][-1]['status']}", file=sys.stderr, flush=True)
            summary = {}
            for case, rounds in got.items():
                ok = [x for x in rounds if x["status"] == "ok"]
                summary[case] = {**rounds[-1], "samples_per_s": statistics.median(x["samples_per_s"] for x in ok)
                                 if ok else None}
            results.append({"model": model, "backend": backend, "budgets": planned, "cases": summary})
            print(table(model, backend, planned, summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def table(model: str, backend: str, planned: list[float], cases: dict) -> str:
    lines = [f"\n{model}, {backend}", "| budget GiB | plan | estimate MiB | measured MiB | within +10% | samples/s | "
             "fastest hand-set that fits | its samples/s | auto / it |", "|---|---|---|---|---|---|---|---|---|"]
    hand = {k: v for k, v in cases.items() if not k.startswith("auto") and v["status"] == "ok"}
    for b in planned:
        c = cases[f"auto {b:g}"]
        if c["status"] != "ok":
            lines.append(f"| {b:g} | {c['status']}: {c.get('error')} | | | | | | | |")
            continue
        fits = {k: v for k, v in hand.items() if v["peak"] <= b * GiB}
        best = max(fits, key=lambda k: fits[k]["samples_per_s"], default=None)
        theirs = fits[best]["samples_per_s"] if best else None
        lines.append(f"| {b:g} | {c['plan']} | {c['estimate'] / 2**20:.1f} | {c['peak'] / 2**20:.1f} | "
                     f"{'yes' if c['peak'] <= 1.1 * b * GiB else 'NO'} | {c['samples_per_s']:.2f} | {best or '-'} | "
                     + (f"{theirs:.2f} | {c['samples_per_s'] / theirs:.2f} |" if theirs else " | |"))
    lines.append("hand-set: " + "; ".join(f"{k} {v['peak'] / 2**20:.1f} MiB {v['samples_per_s']:.2f}/s"
                                          for k, v in hand.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
