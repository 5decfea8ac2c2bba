#!/usr/bin/env python
"""The planner's accuracy on the model zoo (issue 40): for each zoo model, every fitting candidate of
one question measured (the grid, two rounds), the planner's predictions before any run, and its race.

    python benchmarks/zoo_accuracy.py grid --runs_dir runs/zoo/cpu-2core --models llama vit cnn_bn gru_lm
    python benchmarks/zoo_accuracy.py plan --runs_dir runs/zoo/cpu-2core --models llama vit cnn_bn gru_lm
    python -m analysis.compact runs/zoo/cpu-2core --out runs/reference/cpu-2core-zoo-NAME   # what is kept
    python benchmarks/zoo_accuracy.py page --runs_dir runs/reference/cpu-2core-zoo-NAME [MORE_DIRS] \
        --out docs/results/zoo_NAME_DATE.md

RUNS_DIR is scratch (thousands of files: logs, locks, per-step metrics); what is committed is its compact
form (analysis/compact.py: a README and one records.jsonl), which `page` and every reader here read as
they read RUNS_DIR.

`grid` and `plan` (benchmarks: on an otherwise idle machine) write, per model, into RUNS_DIR/MODEL:
  grid/       every fitting candidate of the question, --rounds times taking turns, ordinary records
              (the sweep runner's: a record already there is kept, not run again)
  grid.json   each grid run's name, flags, status, samples/s and launch-to-end seconds
  plan.json   (`plan`) `python -m analysis.plan QUESTION --race --backend_costs measure --json`: every
              candidate's prediction (made before any run: `pred_samples_per_s`), the race's rounds
              and pick, and the model refitted on the race's runs (`refit_samples_per_s`); its runs
              in RUNS_DIR/MODEL/race. Each configuration's own costs (analysis/plan/backend_costs.py)
              are measured by the first plan on the probe model and kept in RUNS_DIR/backend_costs.json
  plan_time.json  the seconds of that command, launch to end
The question (`grid --question`, named in RUNS_DIR/MODEL/question.json; QUESTIONS): world2 (the
default): world 2, global batch 16, a budget every candidate fits (1 GiB), the configurations
CONFIGS, micro-batches 4 and 8, checkpointing none and full/1 (none alone where a model has no
blocks); deepspeed-world1: world 1, ZeRO-0 to 3, micro-batches 1 to 16, no checkpointing; single-world1:
world 1, one process, micro-batches 2 to 16, checkpointing none and full/1 (a lent GPU's:
benchmarks/gpu_zoo.sh). QUESTIONS and CONFIGS are in benchmarks/zoo_figures.py, which reads the records.

    python benchmarks/zoo_accuracy.py grid --question deepspeed-world1 --runs_dir D --models vit mixtral
    python benchmarks/zoo_accuracy.py plan --runs_dir D --models vit mixtral
    python benchmarks/zoo_accuracy.py autotune --runs_dir D --models vit mixtral

`autotune` (after those two) runs DeepSpeed's autotuner (`deepspeed --autotuning tune`, fast mode) on
the deepspeed-world1 question, its files in RUNS_DIR/MODEL/autotune, then its pick, the race's and
the grid's best, measured alike (--rounds times taking turns): RUNS_DIR/MODEL/autotune.json.

`page` reads those files only (nothing runs) and writes the accuracy page: per model, the median and
worst |predicted/measured - 1| of samples/s before and after the refit, Spearman's rank correlation
of predicted and measured, the race's regret against the grid's best, the share of the grid's steps
and run time the race used, and the estimator's peak (as it is now) against each grid run's; and
where `autotune` ran, the autotuner head to head with the race. A folder of grids without plans
(`grid` alone: measured for the peaks) gets a table of the peaks alone. A page is written once and
dated (docs/results/); it is never written again nor compared with the records: tests/unit/test_reference.py
holds the committed records to the bounds of runs/reference/index.yaml with the code as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from analysis import compact, plan  # noqa: E402 (compact: the records read as they are, a folder or its compact form)
from analysis.plan.verify import RACE_SHARE, RACE_WITHIN  # noqa: E402
import backends  # noqa: E402
from benchmarks.zoo import ZOO  # noqa: E402
from benchmarks.zoo_figures import (DEEPSPEED, QUESTIONS, Question, head_to_head, model_accuracy,  # noqa: E402
                                    peak_accuracy, question_of, race_on_grid)
from core.environment import git_commit  # noqa: E402
from orchestration.runner import Runner  # noqa: E402
from orchestration.sweep import SweepRun  # noqa: E402


def question(out: Path) -> list[str]:
    """The question's flags for the model whose grid is in `out`: checkpointing none alone where no grid
    candidate checkpoints (a model without blocks: the planner refuses full/1 for it)."""
    q = question_of(out)
    grid = compact.read_json(out / "grid.json")
    ckpt = q.ckpt if any("--ckpt_interval" in g["flags"] for g in grid) else ("none",)
    return q.argv(ckpt)


def _grid(model_flags: list[str], q: Question):
    """The question's fitting candidates (listed without timing anything: the device is a placeholder)."""
    link = plan.Link(1.0, 0.0, "placeholder")
    device = plan.Device("this machine, uncalibrated", link, link, sample_s=1e-3)
    rows = plan.plan(model_flags, q.world, q.world, 1.0, 16, device, list(q.configs), q.ckpt, list(q.micro_batches))
    return [r for r in rows if r.get("fits")]


def grid(runs_dir: Path, names: list[str], rounds: int, steps: int, qname: str = "world2") -> None:
    """`grid`: each model's fitting candidates of question `qname` measured, `rounds` times taking
    turns, into RUNS_DIR/MODEL/grid."""
    for name in names:
        model = ZOO[name]
        out = runs_dir / name
        q = QUESTIONS[qname]
        if (out / "grid.json").is_file() and question_of(out) != q:
            sys.exit(f"{out}: its records answer another question than {qname}")
        out.mkdir(parents=True, exist_ok=True)
        if qname != "world2":
            (out / "question.json").write_text(json.dumps({"question": qname}) + "\n")
        cands = _grid(list(model.flags), q)
        print(f"{name}: {len(cands)} fitting candidates, {rounds} rounds", flush=True)
        runner = Runner(out / "grid", 1800)
        done = []
        for rnd in range(rounds):
            for i, row in enumerate(cands):
                cand = row["candidate"]
                pairs = plan.flag_pairs([*model.flags, *cand.flags()[2:], "--steps", str(steps), "--warmup_steps",
                                         "2", "--mem_profile_steps", "1", "--eval_batches", "1"])
                outcome = runner.run(SweepRun(f"{cand.run_name()}-r{rnd}", row["backend"], cand.file, q.world, pairs))
                print(f"  round {rnd + 1}/{rounds} [{i + 1}/{len(cands)}] {outcome.line()}", flush=True)
                s = outcome.summary
                done.append({"name": outcome.run.name, "flags": cand.flags(), "round": rnd, "status": outcome.status,
                             "steps": steps, "samples_per_s": s.samples_per_s, "mem_peak_bytes": s.mem_peak_bytes,
                             "seconds": None if outcome.skipped else outcome.seconds})
        if any(d["seconds"] is None for d in done) and (out / "grid.json").is_file():
            # records reused: their seconds are the earlier grid.json's
            before = {d["name"]: d["seconds"] for d in json.loads((out / "grid.json").read_text())}
            done = [{**d, "seconds": d["seconds"] if d["seconds"] is not None else before.get(d["name"])} for d in done]
        (out / "grid.json").write_text(json.dumps(done, indent=1) + "\n")


def _plan_json(name: str, proc: subprocess.CompletedProcess) -> str:
    """A plan's JSON answer, or exit: 1 is a plan's 'nothing fits' (its JSON printed) and a Python
    traceback's too (nothing printed; live on the GRU, 2026-12-03: an empty plan.json written)."""
    try:
        json.loads(proc.stdout)
    except ValueError:
        sys.exit(f"{name}: analysis.plan failed ({proc.returncode}, no JSON answer; its error above)")
    if proc.returncode not in (0, 1):
        sys.exit(f"{name}: analysis.plan failed ({proc.returncode})")
    return proc.stdout


def plan_and_race(runs_dir: Path, names: list[str], steps: int) -> None:
    """`plan`: each model's plan (predictions before any run) and race, RUNS_DIR/MODEL/plan.json."""
    for name in names:
        out = runs_dir / name
        if (out / "race").exists():
            sys.exit(f"{out / 'race'} exists: a race reuses no record (its runs' seconds are what it costs); "
                     "move it away first")
        # Each configuration's own costs measured on the first model's plan (on the probe model, not a
        # zoo model) and kept beside the records with the link between the ranks (probed once, on the
        # first plan): every model's plan prices them alike.
        env = {**os.environ, "GPTLITE_BACKEND_COSTS": str(runs_dir / "backend_costs.json")}
        # The step model without the configurations' own costs (as it was before issue 40's item 2):
        # predictions only, nothing run.
        proc = subprocess.run([sys.executable, "-m", "analysis.plan", *question(out), "--backend_costs", "off", "--json",
                               *ZOO[name].flags], cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
        (out / "plan_without_own_costs.json").write_text(_plan_json(name, proc))
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "analysis.plan", *question(out), "--race", "--verify_steps", str(steps),
                               "--backend_costs", "measure", "--runs_dir", str(out / "race"), "--json",
                               *ZOO[name].flags], cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)  # progress: stderr
        (out / "plan.json").write_text(_plan_json(name, proc))
        (out / "plan_time.json").write_text(json.dumps({"seconds": time.perf_counter() - started}) + "\n")
        print(f"{name}: planned and raced", flush=True)


def autotune(runs_dir: Path, names: list[str], steps: int, rounds: int) -> None:
    """`autotune`: DeepSpeed's autotuner on each model's deepspeed-world1 question (its grid and plan made
    first, into the same folder), then its pick, the race's and the grid's best measured `rounds` times
    taking turns, one harness for all: RUNS_DIR/MODEL/autotune.json, the autotuner's files in
    RUNS_DIR/MODEL/autotune/."""
    q = QUESTIONS["deepspeed-world1"]
    for name in names:
        out = runs_dir / name
        if question_of(out) != q or not (out / "plan.json").is_file():
            sys.exit(f"{out}: run `grid --question deepspeed-world1` and `plan` into it first")
        tuned = out / "autotune"
        if tuned.exists():
            sys.exit(f"{tuned} exists: the autotuner's time is what it costs (nothing reused); move it away first")
        tuned.mkdir()
        # The user's config as the autotuner takes it: the stages and micro-batches of the question (each
        # experiment's gradient accumulation makes global batch 16), the rest as every ds_configs/ file
        # has it; its fast mode (micro-batch and stage only), metric throughput over the timed steps.
        cfg = json.loads((REPO / DEEPSPEED[0]).read_text())
        cfg["zero_optimization"] = {"stage": [0, 1, 2, 3]}
        cfg["train_micro_batch_size_per_gpu"] = list(q.micro_batches)
        cfg["gradient_accumulation_steps"] = 1
        cfg["autotuning"] = {"enabled": True, "fast": True, "metric": "throughput", "start_profile_step": 2,
                             "end_profile_step": steps - 1, "max_train_batch_size": 16,
                             "results_dir": str(tuned / "results"), "exps_dir": str(tuned / "exps")}
        (tuned / "ds_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        # DeepSpeed's launcher, whose autotuner this compares with
        command = [backends.get_backend(backends.DEEPSPEED).launcher, "--autotuning", "tune", "--num_gpus", "1",
                   "train.py", "--deepspeed_config",
                   _rel(tuned / "ds_config.json"), *ZOO[name].flags, "--steps", str(steps), "--warmup_steps", "2",
                   "--eval_batches", "1", "--runs_dir", _rel(tuned / "runs")]
        print(f"{name}: {' '.join(command)}", flush=True)
        started = time.perf_counter()
        with open(tuned / "autotuner.log", "w") as log:
            proc = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - started
        optimal = tuned / "results" / "ds_config_optimal.json"
        if proc.returncode or not optimal.is_file():
            sys.exit(f"{name}: the autotuner ended {proc.returncode} without a pick: {tuned / 'autotuner.log'}")
        experiments = sorted(tuned.glob("results/*/metrics.json"))
        best = json.loads(optimal.read_text())
        tuner_flags = ["--deepspeed_config", _rel(optimal), "--micro_batch", str(best["train_micro_batch_size_per_gpu"]),
                       "--grad_accum", str(best["gradient_accumulation_steps"])]
        # The picks and the grid's best, measured alike: one harness, `rounds` times taking turns.
        acc = model_accuracy(out, estimate=lambda record: 1)  # its grid's best and the race's pick; no peaks
        contenders = {"autotuner": tuner_flags, "race": acc["pick"].split(), "grid": acc["best"].split()}
        runner = Runner(tuned / "final", 1800)
        final: dict[str, list] = {who: [] for who in contenders}
        for rnd in range(rounds):
            for who, flags in contenders.items():
                fl = plan.flag_pairs([*ZOO[name].flags, *flags, "--steps", str(steps), "--warmup_steps", "2",
                                         "--mem_profile_steps", "1", "--eval_batches", "1"])
                config = dict(fl)["deepspeed_config"]
                pairs = tuple((k, v) for k, v in fl if k != "deepspeed_config")
                outcome = runner.run(SweepRun(f"{who}-r{rnd}", backends.DEEPSPEED, config, 1, pairs))
                print(f"  final {rnd + 1}/{rounds} {who}: {outcome.line()}", flush=True)
                final[who].append(outcome.summary.samples_per_s if outcome.status == "ok" else None)
        (out / "autotune.json").write_text(json.dumps({
            "command": " ".join(command), "seconds": seconds, "experiments": len(experiments),
            "experiment_metrics": {m.parent.name: json.loads(m.read_text()) for m in experiments},
            "pick": " ".join(tuner_flags), "race_pick": acc["pick"], "grid_best": acc["best"], "final": final},
            indent=1) + "\n")


def _short(flags: str) -> str:
    """A pick's flags, the config file by its name."""
    return " ".join(Path(f).name if f.endswith(".json") else f for f in flags.split())


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}" if abs(x) >= 0.095 else f"{x:.1%}"


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def _peaks_table(runs_dir: Path) -> list[str]:
    lines = ["| model | shape | runs | peak error, median / worst (runs beyond 10%) | the worst run |",
             "|---|---|---:|---:|---|"]
    for d in (d for d in compact.iterdir(runs_dir) if compact.is_file(d / "grid.json")):
        a = peak_accuracy(d)
        lines.append(f"| {d.name} | {ZOO[d.name].shape if d.name in ZOO else ''} | {a['peak_runs']} | "
                     f"{_pct(a['peak_median'])} / {a['peak_worst']:+.1%} ({a['peak_beyond']} of {a['peak_runs']}) | "
                     f"{a['peak_worst_run']} |")
    return lines


def page(runs_dirs: list[Path]) -> str:
    """The accuracy page's text: a section per records folder of RUNS_DIRS (each a folder of models,
    each with grid.json and plan.json; or grid.json alone: the peaks alone), headed by the first
    paragraph of the folder's README after its title."""
    lines = ["# The planner on the model zoo", "",
             "[Back to the planner](../planner.md)", "",
             f"Written {time.strftime('%Y-%m-%d')} at commit {(git_commit().get('commit') or '?')[:8]} by "
             "`python benchmarks/zoo_accuracy.py page --runs_dir "
             f"{' '.join(_rel(d) for d in runs_dirs)} --out THIS_FILE` from the "
             "records (`grid` and `plan` made them: the question and the commands are in "
             "benchmarks/zoo_accuracy.py and the records' README), once: it is not written again. Measured: the median of the grid's two rounds of each candidate. Predicted: the "
             "planner's samples/s before any run, without and with each configuration's own costs (measured on "
             "the probe model: `--backend_costs`); refitted: after the race's runs. Error: |predicted / "
             "measured - 1| over the candidates. Regret: 1 - the pick's measured samples/s / the grid's best. "
             "The race's share: its steps against every fitting candidate's once (as long), and its runs' "
             "seconds (launch to end) against one pass of the grid's. Rounds' spread: how far the grid's own "
             "rounds of one candidate lie apart (the faster / the slower - 1, the median over the candidates), "
             "the measurement's repeatability on this machine. Peak error: the estimator's peak (at the commit above, "
             "from each record's config.json) against each grid run's measured peak: the median and worst "
             "|estimated / measured - 1| of the runs, and how many lie beyond 10%. Peaks recorded before "
             "2026-11-29 (commit 140ba42) may count a gloo collective's buffers, freed unseen by gloo's worker "
             "thread, as alive to the step's end (core/memory_profile.py): the folders with a table of peaks "
             "alone measured every candidate once again after that fix."]
    for runs_dir in runs_dirs:
        readme = (runs_dir / "README.md").read_text().split("\n\n") if (runs_dir / "README.md").is_file() else []
        lines += ["", f"## {_rel(runs_dir)}", ""]
        if len(readme) > 1:
            lines += [" ".join(readme[1].split()), ""]
        if not any(compact.is_file(d / "plan.json") for d in compact.iterdir(runs_dir)):
            lines += _peaks_table(runs_dir)  # measured for the peaks alone: no plan, no race
            continue
        lines += ["| model | shape | candidates | rounds' spread | error without own costs, median / worst (Spearman) | "
                  "error predicted, median / worst | Spearman | error refitted, median / worst | "
                  "regret of the predicted pick | regret of the race | race's steps / grid's | "
                  "race's run time / grid's | peak error, median / worst (runs beyond 10%) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        models = [(d, model_accuracy(d)) for d in compact.iterdir(runs_dir)
                  if compact.is_file(d / "plan.json") and compact.is_file(d / "grid.json")]
        for d, a in models:
            shape = ZOO[d.name].shape if d.name in ZOO else ""
            w = a["without_own_costs"]
            bare = f"{_pct(w['median'])} / {_pct(w['worst'])} ({w['spearman']:.2f})" if w else "-"
            lines.append(
                f"| {d.name} | {shape} | {a['candidates']} | {_pct(a['rounds_spread'])} | {bare} | "
                f"{_pct(a['median_before'])} / {_pct(a['worst_before'])} | {a['spearman']:.2f} | "
                f"{_pct(a['median_after'])} / {_pct(a['worst_after'])} | {_pct(a['regret_predicted'])} | "
                f"{_pct(a['regret'])} | {_pct(a['steps_share'])} | {_pct(a['time_share'])} "
                f"({a['race_seconds']:.0f} s / {a['grid_seconds']:.0f} s) | {_pct(a['peak_median'])} / "
                f"{a['peak_worst']:+.1%} ({a['peak_beyond']} of {a['peak_runs']}) |")
        lines += ["", "Each model's best measured candidate, the predicted pick and the race's pick:", ""]
        for d, a in models:
            lines.append(f"- {d.name}: best `{a['best']}`; predicted `{a['predicted_pick']}`; raced `{a['pick']}`")
        ran = sorted({a["race_within"] for _, a in models})
        lines += ["", "The race's entry rule on the grid's records (`race_on_grid`: the race's code at the commit above, "
                  "nothing run; each race run is the candidate's next grid round, charged that run's seconds): every "
                  f"configuration entered (`--race_within 0`, no bound on the runs) against those predicted within "
                  f"{RACE_WITHIN} of the best (`--race_within {RACE_WITHIN}`, the default since 2026-11-28), with the "
                  f"race's bound of {RACE_SHARE:g} of the grid's runs (RACE_SHARE, since 2026-12-04). The race above ran with "
                  f"`--race_within {' and '.join(f'{w:g}' for w in ran)}`. Left out: the best "
                  "grid median among the configurations the rule left out, as a share of the grid's best (below 1: "
                  "none of them would have won).", "",
                  "| model | every configuration: runs, steps / time share, regret | within "
                  f"{RACE_WITHIN}: configurations entered, runs | steps share | time share | regret | left out, best |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for d, a in models:
            every, rule = race_on_grid(d, a, 0.0, bounded=False), race_on_grid(d, a, RACE_WITHIN)
            lines.append(
                f"| {d.name} | {every['runs']}, {_pct(every['steps_share'])} / {_pct(every['time_share'])}, "
                f"{_pct(every['regret'])} | {rule['entrants']} of {rule['configurations']}, {rule['runs']} | "
                f"{_pct(rule['steps_share'])} | {_pct(rule['time_share'])} ({rule['seconds']:.0f} s) | "
                f"{_pct(rule['regret'])} | "
                + (f"{rule['left_out_best']:.2f} |" if rule["left_out_best"] is not None else "- |"))
        tuned = [(d, a, head_to_head(d, a)) for d, a in models if compact.is_file(d / "autotune.json")]
        if tuned:
            lines += ["", "DeepSpeed's autotuner head to head (`zoo_accuracy.py autotune`): its fast mode over the same "
                      "stages and micro-batches, against the planner's race. Each pick as the grid candidate of its "
                      "stage and micro-batch, its regret by the grid's medians (the autotuner's config keeps "
                      "DeepSpeed's defaults for the rest: buckets, overlap). Then the picks and the grid's best "
                      "measured alike, taking turns (final runs: the median and the range of samples/s, the highest peak: the "
                      "question's budget is 1 GiB). Time: "
                      "the autotuner's whole command; the race's runs, launch to end, and its whole plan command (the "
                      "first model's includes measuring the configurations' own costs); one pass of the grid.", "",
                      "| model | autotuner: experiments, time | its pick | regret | race: runs, time (plan command) | "
                      "its pick | regret | grid: candidates, one pass | its best | final runs: autotuner / race / "
                      "grid's best, samples/s (range), peak |",
                      "|---|---:|---|---:|---:|---|---:|---:|---|---|"]
            for d, a, h in tuned:
                fin = " / ".join(f"{h['final_median'][w]:.0f} ({h['final_range'][w][0]:.0f}-{h['final_range'][w][1]:.0f}), "
                                 f"{(h['final_peak_bytes'][w] or 0) / 2**20:.1f} MiB"
                                 if h["final_median"][w] else "failed" for w in ("autotuner", "race", "grid"))
                lines.append(
                    f"| {d.name} | {h['experiments']}, {h['seconds']:.0f} s | `{_short(h['picks']['autotuner'])}` | "
                    f"{_pct(h['regret']['autotuner'])} | {a['race_runs']}, {a['race_seconds']:.0f} s "
                    f"({h['plan_seconds']:.0f} s) | `{_short(h['picks']['race'])}` | {_pct(h['regret']['race'])} | "
                    f"{a['candidates']}, {a['grid_seconds']:.0f} s | `{_short(h['picks']['grid'])}` | {fin} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    sub = p.add_subparsers(dest="command", required=True)
    for name, what in (("grid", "measure every fitting candidate (a benchmark: an idle machine)"),
                       ("plan", "the planner's predictions and its race (a benchmark: an idle machine)"),
                       ("autotune", "DeepSpeed's autotuner on the deepspeed-world1 question, and the picks measured "
                                    "alike (after grid and plan; a benchmark: an idle machine)")):
        r = sub.add_parser(name, help=what)
        r.add_argument("--runs_dir", required=True, type=Path)
        r.add_argument("--models", nargs="+", required=True, help="zoo models (benchmarks/zoo)")
        r.add_argument("--steps", type=int, default=8, help="each run's steps (the race's, the autotuner's experiments')")
        if name == "grid":
            r.add_argument("--rounds", type=int, default=2)
            r.add_argument("--question", choices=sorted(QUESTIONS), default="world2",
                           help="world2: every backend at world 2; deepspeed-world1: the stages at world 1, "
                                "micro-batches 1-16 (what the autotuner searches); single-world1: one process, "
                                "micro-batches 2-16, checkpointing none and every block (a lent GPU's)")
        if name == "autotune":
            r.add_argument("--rounds", type=int, default=3, help="rounds of the picks' measurement, taking turns")
    g = sub.add_parser("page", help="write the accuracy page from the records (nothing runs)")
    g.add_argument("--runs_dir", required=True, type=Path, nargs="+", help="records folders, a section each")
    g.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    if args.command == "page":
        args.out.write_text(page([d.resolve() for d in args.runs_dir]))
        return
    unknown = [m for m in args.models if m not in ZOO]
    if unknown:
        p.error(f"--models {' '.join(unknown)}: not in the zoo ({', '.join(ZOO)})")
    if args.command == "grid":
        grid(args.runs_dir.resolve(), args.models, args.rounds, args.steps, args.question)
    elif args.command == "autotune":
        autotune(args.runs_dir.resolve(), args.models, args.steps, args.rounds)
    else:
        plan_and_race(args.runs_dir.resolve(), args.models, args.steps)


if __name__ == "__main__":
    main()
