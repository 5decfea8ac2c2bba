#!/usr/bin/env python
"""The planner's regret on this machine: every candidate that fits the budget measured (the grid), then
`analysis.plan --verify K` run on its own, and its pick's measured samples/s against the best of the grid.

    python benchmarks/plan_regret.py --runs_dir /tmp/regret --mem_budget_gb 0.2 --global_batch 16 \\
        --configs ddp fsdp_configs/fsdp2.yaml ds_configs/z2.json ds_configs/z3.json \\
        --ckpt none full/1 full/2 selective/1 -- --preset small

The grid is the planner's own candidates (analysis.plan.plan with the same question and --configs,
--ckpt, --micro_batches), each that fits run --rounds times through the sweep runner into
RUNS_DIR/grid (rounds in turn; samples/s is the median over rounds). The verification is a separate
`python -m analysis.plan ... --verify K --json --out RUNS_DIR/plan` into RUNS_DIR/verify, so its runs
are measured on their own (its plan.md and plan.png in RUNS_DIR/plan, its JSON in RUNS_DIR/plan.json).
A grid record already in RUNS_DIR/grid is kept, not run again (the sweep runner's rule), so `--grid_only`
then the same command without it splits the work in two (a lent GPU's per-call limit).
Prints the table (candidate, predicted, refitted, measured), the best measured candidate, the pick,
regret = 1 - pick's grid samples/s / best's, how many runs the planner made against the grid, and
whether any picked or verified run went over the budget. A benchmark, not a test: run it on an
otherwise idle machine.

    python benchmarks/plan_regret.py --replay runs/reference/nvidia-h100-80gb-hbm3-plan/plan_regret

--replay DIR runs nothing: it refits DIR/plan.json's verified runs with this code's refit
(analysis.plan.replay) and prints, for each, the prediction as the plan ran, refitted then and now,
and measured; then the grid's records in DIR/grid against the refitted prediction now.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from analysis import compact  # noqa: E402 (a RUNS_DIR read as it is: a folder, or in its compact form)
from analysis import plan  # noqa: E402
from orchestration.runner import Runner  # noqa: E402
from orchestration.sweep import SweepRun  # noqa: E402


def grid_medians(directory: Path) -> dict[str, float]:
    """DIR/grid's records: each candidate's median samples/s over its rounds (a failed run left out), by
    its run name (plan.Candidate.run_name)."""
    grid: dict[str, list[float]] = {}
    records = compact.iterdir(directory / "grid") if compact.is_dir(directory / "grid") else []
    for record in records:
        if not compact.is_file(record / "summary.json"):
            continue
        s = compact.read_json(record / "summary.json")
        if s.get("status") == "ok" and s.get("samples_per_s"):
            grid.setdefault(record.name.rsplit("-r", 1)[0], []).append(s["samples_per_s"])
    return {k: statistics.median(v) for k, v in grid.items()}


def run_name(row: dict) -> str:
    """A plan's candidate row's record name in the grid, less its round."""
    micro, accum = (int(x) for x in row["micro x accum"].split("x"))
    return plan.Candidate(row["config"], micro, accum, row["ckpt"], row.get("base")).run_name()


def pick_regret(directory: Path) -> float:
    """1 - the plan's pick's samples/s / the grid's best, by DIR/grid's medians (DIR/plan.json's pick)."""
    saved = compact.read_json(directory / "plan.json")
    medians = grid_medians(directory)
    pick = next(c for c in saved["candidates"] if c.get("command") == saved["pick"])
    return 1 - medians.get(run_name(pick), 0.0) / max(medians.values())


def replay(directory: Path) -> int:
    """--replay DIR: DIR/plan.json refitted by this code (nothing run), against its verified runs and
    DIR/grid's records."""
    path = directory / "plan.json"
    try:
        saved = compact.read_json(path)
        out = plan.replay(saved)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        if isinstance(e, OSError):
            problem = f"cannot read it ({e.strerror or e})"
        elif isinstance(e, json.JSONDecodeError):
            problem = f"not JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        elif isinstance(e, RecursionError):
            problem = "nested too deeply to be a plan"
        elif isinstance(e, ValueError):  # plan.replay's own word on what it holds
            problem = str(e)
        else:  # a key missing or of another type, in what is otherwise a plan
            problem = f"not a plan analysis.plan --verify K --json wrote ({type(e).__name__}: {e})"
        print(f"plan_regret.py: error: --replay {path}: {problem}", file=sys.stderr)
        return 2
    fitted, then = out["refit"], out["refit_as_ran"] or {}
    print(f"refit now: compute x {fitted['compute_factor']:.3g}, micro-steps' fixed cost x "
          f"{fitted.get('micro_step_factor', fitted['compute_factor']):.3g}, overlap {fitted['overlap']:.2f}, "
          f"overhead {', '.join(f'{c} x {o:.3g}' for c, o in fitted['overhead'].items())}; "
          f"as the plan ran: compute x {then.get('compute_factor', float('nan')):.3g}, overhead "
          f"{', '.join(f'{c} x {o:.3g}' for c, o in then.get('overhead', {}).items()) or '-'}")
    flags = {c["command"]: " ".join(c["config_flags"]) for c in out["candidates"] if "command" in c}
    print(f"\n{'verified candidate':<80} {'predicted':>9} {'refit then':>10} {'refit now':>9} {'measured':>8} "
          f"{'then':>7} {'now':>7}")
    for v in out["verified"]:
        m, then_, now = v["measured_samples_per_s"], v["refit_as_ran"], v["refit_samples_per_s"]
        print(f"{flags[v['command']]:<80} {v['pred_samples_per_s']:9.1f} {then_ or float('nan'):10.1f} {now:9.1f} "
              f"{m:8.1f} {(then_ or float('nan')) / m - 1:+7.1%} {now / m - 1:+7.1%}")
    worst = max(out["verified"], key=lambda v: abs(v["refit_samples_per_s"] / v["measured_samples_per_s"] - 1))
    print(f"largest error now: {worst['refit_samples_per_s'] / worst['measured_samples_per_s'] - 1:+.1%} "
          f"({flags[worst['command']]})")
    grid = grid_medians(directory)
    if grid:
        print(f"\n{'grid candidate':<80} {'refit now':>9} {'grid':>8} {'error':>7}")
        for r in out["candidates"]:
            if "refit_samples_per_s" not in r:
                continue
            name = run_name(r)
            if name in grid:
                g = grid[name]
                print(f"{flags[r['command']]:<80} {r['refit_samples_per_s']:9.1f} {g:8.1f} "
                      f"{r['refit_samples_per_s'] / g - 1:+7.1%}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--replay", metavar="DIR", help="refit DIR/plan.json by this code, nothing run (alone: see below)")
    p.add_argument("--runs_dir", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mem_budget_gb", type=float, required=True)
    p.add_argument("--global_batch", type=int, required=True)
    p.add_argument("--configs", nargs="+", required=True)
    p.add_argument("--ckpt", nargs="+", default=["none", "full/1", "full/2", "selective/1"])
    p.add_argument("--micro_batches", type=int, nargs="+", default=None)
    p.add_argument("--verify", type=int, default=3)
    p.add_argument("--verify_rounds", type=int, default=1, help="analysis.plan's: each verified candidate run R times")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--counted", action="store_true", help="analysis.plan's: price the collectives counted under the "
                   "fake process group")
    p.add_argument("--grid_only", action="store_true",
                   help="measure the grid and stop; a later run with the same RUNS_DIR keeps its records (a lent "
                        "GPU's call limit can split the two)")
    p.add_argument("train_argv", nargs="*", help="train.py's model flags, after --")
    return p


def measure_grid(args, runs: Path, grid: list[dict]) -> tuple[dict, dict]:
    """Every candidate of the grid run --rounds times, taking turns: the samples/s of each (by its
    flags) and its highest peak in GiB."""
    runner = Runner(runs / "grid", 1800)
    measured: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    for rnd in range(args.rounds):
        for i, row in enumerate(grid):
            cand = row["candidate"]
            name = f"{cand.run_name()}-r{rnd}"
            pairs = plan.flag_pairs([*args.train_argv, *cand.flags()[2:], "--steps", str(args.steps),
                                     "--warmup_steps", "2", "--mem_profile_steps", "1", "--eval_batches", "1"])
            outcome = runner.run(SweepRun(name, row["backend"], cand.file, args.world, pairs))
            print(f"round {rnd + 1}/{args.rounds} [{i + 1}/{len(grid)}] {outcome.line()}", flush=True)
            key = " ".join(cand.flags())
            if outcome.status == "ok" and outcome.summary.samples_per_s:
                measured.setdefault(key, []).append(outcome.summary.samples_per_s)
                peaks[key] = max(peaks.get(key, 0.0), (outcome.summary.mem_peak_bytes or 0) / 2**30)
    return measured, peaks


def print_comparison(args, out: dict, measured: dict, peaks: dict, grid: list[dict]) -> None:
    """The planner's predictions beside the grid's measurements, its pick and its regret."""
    median = {k: statistics.median(v) for k, v in measured.items()}
    best = max(median, key=median.get)
    flags_of = {c["command"]: " ".join(c["config_flags"]) for c in out["candidates"] if "command" in c}
    print(f"\n{'candidate':<70} {'predicted':>9} {'refit':>7} {'grid':>7} {'verify':>7} {'peak GiB':>8}")
    verified = {flags_of[v["command"]]: v for v in out.get("verified", [])}
    for c in out["candidates"]:
        key = " ".join(c["config_flags"])
        if key not in median:
            continue
        v = verified.get(key, {})
        print(f"{key:<70} {c['pred_samples_per_s']:9.2f} {c.get('refit_samples_per_s', float('nan')):7.2f} "
              f"{median[key]:7.2f} {v.get('measured_samples_per_s') or float('nan'):7.2f} {peaks[key]:8.3f}"
              f"{'  <- verified' if v else ''}")
    pick = flags_of.get(out["pick"]) if out["pick"] else None
    print(f"\nbest measured in the grid: {best} ({median[best]:.2f} samples/s, median of {len(measured[best])})")
    if pick:
        print(f"the planner's pick: {pick} (grid {median.get(pick, float('nan')):.2f} samples/s); "
              f"regret {1 - median.get(pick, 0.0) / median[best]:.1%}")
    each = f" ({args.verify_rounds} runs each)" if args.verify_rounds > 1 else ""
    print(f"candidates the planner ran: {len(out.get('verified', []))}{each} against a grid of {len(grid)}")
    over = [v for v in out.get("verified", []) if (v.get("measured_peak_gb") or 0) > args.mem_budget_gb]
    print(f"verified runs over the budget: {len(over)}; grid runs over the budget: "
          f"{sum(peak > args.mem_budget_gb for peak in peaks.values())}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--replay"]:
        if len(argv) != 2:
            print("usage: benchmarks/plan_regret.py --replay DIR (a plan_regret RUNS_DIR: its plan.json, grid/)",
                  file=sys.stderr)
            return 2
        return replay(Path(argv[1]))
    p = build_parser()
    args = p.parse_args(argv)
    runs = Path(args.runs_dir).resolve()
    question = ["--world", str(args.world), "--mem_budget_gb", str(args.mem_budget_gb), "--global_batch",
                str(args.global_batch), "--configs", *args.configs, "--ckpt", *args.ckpt,
                *(["--micro_batches", *map(str, args.micro_batches)] if args.micro_batches else [])]
    # The grid: the planner's candidates that fit on this machine's device (estimated there); their
    # predicted speed is not needed to list them, so this device's model is a placeholder, not calibrated.
    link = plan.Link(1.0, 0.0, "placeholder")
    device = plan.Device("this machine, uncalibrated", link, link, sample_s=1e-3)
    rows = plan.plan(args.train_argv, args.world, args.world, args.mem_budget_gb, args.global_batch, device,
                     args.configs, tuple(args.ckpt), args.micro_batches)
    grid = [r for r in rows if r.get("fits")]
    print(f"grid: {len(grid)} candidates fit of {len(rows)} ({sum('breaks' in r for r in rows)} over the budget, "
          f"{sum('refused' in r for r in rows)} refused)", flush=True)
    measured, peaks = measure_grid(args, runs, grid)
    if args.grid_only:
        return 0
    proc = subprocess.run([sys.executable, "-m", "analysis.plan", *question, "--verify", str(args.verify),
                           "--verify_rounds", str(args.verify_rounds), *(["--counted"] if args.counted else []),
                           "--verify_steps", str(args.steps), "--runs_dir", str(runs / "verify"), "--json",
                           "--out", str(runs / "plan"),
                           *args.train_argv], cwd=REPO, stdout=subprocess.PIPE, text=True)  # its progress: stderr
    if proc.returncode not in (0, 1):
        sys.exit(f"analysis.plan failed ({proc.returncode})")
    out = json.loads(proc.stdout)
    (runs / "plan.json").write_text(json.dumps(out, indent=2))
    print_comparison(args, out, measured, peaks, grid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
