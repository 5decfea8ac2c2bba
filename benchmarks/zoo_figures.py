"""The planner's accuracy on the model zoo, read from its records (benchmarks/zoo_accuracy.py makes them
and writes the page): the question a model's records answer, and the figures of one model: the
predictions' errors and rank correlation, the estimator's peaks against the measured ones, the race
replayed on the grid's records, DeepSpeed's autotuner head to head. Nothing here runs anything; each
reader takes a records folder as it is (a folder, or its compact form: analysis/compact.py).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import backends  # noqa: E402
import estimator.estimate  # noqa: E402 (read at each call: a test patches the estimator)
from analysis import compact  # noqa: E402 (the records read as they are: a folder, or its compact form)
from analysis.plan.candidates import GiB  # noqa: E402
from analysis.plan.verify import RACE_SHARE, entrants, race  # noqa: E402
from benchmarks.zoo import ZOO  # noqa: E402

# The questions' spec: analysis.plan's --configs (a backend by its name where it has no file), micro-batches, ...
CONFIGS = (backends.DDP, "fsdp_configs/full_shard.yaml", "fsdp_configs/fsdp2.yaml", "ds_configs/z1.json",
           "ds_configs/z2.json", "ds_configs/z3.json")
DEEPSPEED = tuple(f"ds_configs/z{stage}.json" for stage in range(4))
CKPT = ("none", "full/1")


@dataclass(frozen=True)
class Question:
    """One question the planner is asked of every zoo model: a budget every candidate fits (1 GiB) and
    global batch 16, at `world` ranks, over `configs` x `micro_batches` x `ckpt`."""
    world: int
    configs: tuple[str, ...]
    micro_batches: tuple[int, ...]
    ckpt: tuple[str, ...]

    def argv(self, ckpt: tuple[str, ...] | None = None) -> list[str]:
        return ["--world", str(self.world), "--mem_budget_gb", "1", "--global_batch", "16", "--configs", *self.configs,
                "--micro_batches", *map(str, self.micro_batches), "--ckpt", *(ckpt or self.ckpt)]


QUESTIONS = {
    # world 2, every backend: the accuracy table's question
    "world2": Question(2, CONFIGS, (4, 8), CKPT),
    # world 1, DeepSpeed's stages alone, every micro-batch: what DeepSpeed's autotuner searches (`autotune`)
    "deepspeed-world1": Question(1, DEEPSPEED, (1, 2, 4, 8, 16), ("none",)),
    # world 1, one process, micro-batches and checkpointing: the question one lent GPU can answer in a
    # device session's minutes (benchmarks/gpu_zoo.sh): no process group, no configuration's own costs to
    # probe (single's step is what the compute is calibrated on), 8 candidates a model with blocks
    "single-world1": Question(1, (backends.REFERENCE,), (2, 4, 8, 16), CKPT),
}


def question_of(out: Path) -> Question:
    """The question a model's records answer: RUNS_DIR/MODEL/question.json names it (`grid --question`);
    without it, world2 (the first records were made before there was another)."""
    f = out / "question.json"
    return QUESTIONS[compact.read_json(f)["question"]] if compact.is_file(f) else QUESTIONS["world2"]


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (ties at their mean rank): the Pearson correlation of the ranks."""
    # pandas' method="spearman" needs scipy; the ranks' Pearson correlation is the same figure
    return float(pd.Series(x).rank().corr(pd.Series(y).rank()))


def zoo_file_here(config: dict) -> dict:
    """A record's config.json with its zoo model file (benchmarks/zoo/NAME.py) read from this checkout
    where the path it was recorded by is gone: a run records its --model as the absolute path of the
    checkout it ran in (/work/main, a worktree, another machine's clone)."""
    run = config.get("run") or {}
    model = Path(str(run.get("model", "")))
    files = {Path(f).name: f for m in ZOO.values() for f in m.flags if f.endswith(".py")}  # the zoo's, here
    if model.parent.parts[-2:] == ("benchmarks", "zoo") and model.name in files and not model.is_file():
        return {**config, "run": {**run, "model": files[model.name]}}
    return config


def estimate_from_config(config: dict) -> int:
    """The estimator's peak (bytes) for a run's config.json as the estimator reads any (its zoo model
    file this checkout's where the recorded path is gone: zoo_file_here)."""
    return estimator.estimate.estimate_from_record(zoo_file_here(config)).total_bytes


def record_estimate(record: Path) -> int:
    """The estimator's peak (bytes) for a run record (a folder, or a run of a compact folder)."""
    return estimate_from_config(compact.read_json(record / "config.json"))


def peak_errors(directory: Path, estimate=None) -> list[tuple[str, float]]:
    """Each successful grid run's (name, estimated / measured peak - 1), the estimate being
    `estimate(its record directory)`: by default the estimator as it is now (record_estimate)."""
    estimate = estimate or record_estimate
    return [(g["name"], estimate(directory / "grid" / g["name"]) / g["mem_peak_bytes"] - 1)
            for g in compact.read_json(directory / "grid.json")
            if g["status"] == "ok" and g["samples_per_s"] and g["mem_peak_bytes"]]


def peak_accuracy(directory: Path, estimate=None) -> dict:
    """The peak errors of a model's grid runs: how many, the median and worst |error| (the worst with its
    sign and run), and how many lie beyond 10%."""
    errors = peak_errors(directory, estimate)
    worst = max(errors, key=lambda e: abs(e[1]))
    return {"peak_runs": len(errors), "peak_median": statistics.median(abs(e) for _, e in errors),
            "peak_worst": worst[1], "peak_worst_run": worst[0], "peak_beyond": sum(abs(e) > 0.10 for _, e in errors)}


def model_accuracy(directory: Path, estimate=None) -> dict:
    """One zoo model's figures from its grid.json, grid records and plan.json; each grid run's peak
    against `estimate(its record directory)`, the estimator as it is now (the plan's own estimates
    are of the estimator as it was when the plan ran)."""
    grid = compact.read_json(directory / "grid.json")
    saved = compact.read_json(directory / "plan.json")
    measured: dict[str, list[float]] = {}
    seconds: dict[str, list[float]] = {}
    for g in grid:
        key = " ".join(g["flags"])
        if g["status"] == "ok" and g["samples_per_s"]:
            measured.setdefault(key, []).append(g["samples_per_s"])
        if g["seconds"] is not None:
            seconds.setdefault(key, []).append(g["seconds"])
    grid_median = {k: statistics.median(v) for k, v in measured.items()}
    # The measurement's own repeatability, what no prediction can be held below: each candidate's
    # rounds, the faster over the slower - 1 (the median over the candidates measured twice or more).
    spread = [max(v) / min(v) - 1 for v in measured.values() if len(v) > 1]
    rows = [c for c in saved["candidates"] if c.get("fits") and " ".join(c["config_flags"]) in grid_median]
    pairs = [(c["pred_samples_per_s"], c.get("refit_samples_per_s"), grid_median[" ".join(c["config_flags"])])
             for c in rows]
    before = [abs(p / m - 1) for p, _, m in pairs]
    without = None
    if compact.is_file(directory / "plan_without_own_costs.json"):
        bare = {" ".join(c["config_flags"]): c["pred_samples_per_s"]
                for c in compact.read_json(directory / "plan_without_own_costs.json")["candidates"]
                if c.get("fits")}
        errors = [abs(bare[" ".join(c["config_flags"])] / grid_median[" ".join(c["config_flags"])] - 1)
                  for c in rows if " ".join(c["config_flags"]) in bare]
        without = {"median": statistics.median(errors), "worst": max(errors),
                   "spearman": spearman([bare[" ".join(c["config_flags"])] for c in rows],
                                        [grid_median[" ".join(c["config_flags"])] for c in rows])}
    after = [abs(r / m - 1) for _, r, m in pairs if r]
    race = saved.get("race") or {}
    by_command = {c["command"]: " ".join(c["config_flags"]) for c in saved["candidates"] if "command" in c}
    best = max(grid_median, key=grid_median.get)
    pick = by_command.get(saved.get("pick"))
    predicted_pick = by_command.get(rows and max(rows, key=lambda c: c["pred_samples_per_s"])["command"])
    # The grid's run time: each candidate once at the grid's steps (the race's first round's: its later
    # rounds run longer, so the share is if anything overstated), launch to end, as the race is charged.
    grid_seconds = sum(statistics.median(v) for v in seconds.values())
    return {"without_own_costs": without, "candidates": len(pairs),
            "rounds_spread": statistics.median(spread) if spread else None,
            "median_before": statistics.median(before), "worst_before": max(before),
            "median_after": statistics.median(after) if after else None, "worst_after": max(after) if after else None,
            "spearman": spearman([p[0] for p in pairs], [p[2] for p in pairs]),
            "regret": 1 - grid_median.get(pick, 0.0) / grid_median[best] if pick else None,
            "regret_predicted": 1 - grid_median[predicted_pick] / grid_median[best] if predicted_pick else None,
            "steps_share": race["steps_run"] / race["grid_steps"] if race.get("grid_steps") else None,
            "race_runs": race.get("runs"), "race_seconds": race.get("run_seconds"), "grid_seconds": grid_seconds,
            "time_share": race["run_seconds"] / grid_seconds if race.get("run_seconds") and grid_seconds else None,
            **peak_accuracy(directory, estimate),
            "best": best, "pick": pick, "predicted_pick": predicted_pick, "grid_median": grid_median,
            "race_within": race.get("within", 0.0)}  # the race's entry rule (0: before there was one)


def race_on_grid(directory: Path, acc: dict, within: float, bounded: bool = True) -> dict:
    """The planner's race (analysis.plan.verify.race, its code as it is now) on one model's committed
    records, nothing run: its entrants chosen by `within` from the plan's predictions (made before any
    run), each round's runs read from the grid, a candidate's k-th race run being its grid round k (in
    turn), charged that run's launch-to-end seconds. With the model's figures (`acc`, model_accuracy's):
    the race's runs, its steps and seconds against one pass of the grid's, its pick and the pick's
    regret by the grid's medians, and the best of the configurations it left out. `bounded`: with the
    race's bound on its runs (RACE_SHARE), else none."""
    saved = compact.read_json(directory / "plan.json")
    grid_runs = compact.read_json(directory / "grid.json")
    by_flags: dict[str, list[dict]] = {}
    for g in sorted(grid_runs, key=lambda g: g["round"]):
        by_flags.setdefault(" ".join(g["flags"]), []).append(g)
    rows = [c for c in saved["candidates"] if c.get("fits") and " ".join(c["config_flags"]) in by_flags]
    flags_of = {c["command"]: " ".join(c["config_flags"]) for c in rows}
    taken: dict[str, int] = {}

    def measure(alive: list[dict], rnd: int) -> list[dict]:
        out = []
        for row in alive:
            runs = by_flags[flags_of[row["command"]]]
            g = runs[taken.get(row["command"], 0) % len(runs)]
            taken[row["command"]] = taken.get(row["command"], 0) + 1
            out.append({"command": row["command"], "candidate": flags_of[row["command"]],
                        "status": g["status"], "measured_samples_per_s": g["samples_per_s"],
                        "measured_peak_gb": g["mem_peak_bytes"] / GiB if g["mem_peak_bytes"] else None,
                        "steps": g["steps"], "run_seconds": g["seconds"] or 0.0})
        return out

    raced = race(rows, [], question_of(directory).world, directory, grid_runs[0]["steps"], 0.0, 1.0, within=within,
                 measure=measure, share=RACE_SHARE if bounded else None)
    medians, best = acc["grid_median"], acc["grid_median"][acc["best"]]
    pick = flags_of[raced["pick"]["command"]] if raced["pick"] else None
    entered = {r["config"] for r in entrants(rows, within=within)}
    # How near the rule came to leaving out the winner: the best grid median of the configurations it left out.
    left_out = [medians[flags_of[r["command"]]] for r in rows
                if r["config"] not in entered and flags_of[r["command"]] in medians]
    return {"entrants": len(entered), "configurations": len({r["config"] for r in rows}), "runs": raced["runs"],
            "steps_share": raced["steps_run"] / raced["grid_steps"], "seconds": raced["run_seconds"],
            "time_share": raced["run_seconds"] / acc["grid_seconds"], "pick": pick,
            "regret": 1 - medians[pick] / best if pick else None,
            "left_out_best": max(left_out) / best if left_out else None}


def head_to_head(directory: Path, acc: dict) -> dict:
    """The autotuner against the race on one model, from RUNS_DIR/MODEL/autotune.json, its optimal config
    and the model's figures (`acc`, model_accuracy's): each pick as a grid candidate (the autotuner's: the
    grid's file of its stage, its micro-batch and accumulation; its config keeps DeepSpeed's defaults for
    the rest), its regret by the grid's medians; and the final runs, which measured the picks and the
    grid's best (as they were when `autotune` ran) alike: the median of each (a failed run left out),
    their range and highest peak. Tiny models' steps move far between runs on this machine, so the
    grid's rounds judge, and the final runs show what one more measurement says."""
    h = compact.read_json(directory / "autotune.json")
    best = compact.read_json(directory / "autotune" / "results" / "ds_config_optimal.json")
    stage = best["zero_optimization"]["stage"]
    tuner = (f"--deepspeed_config {DEEPSPEED[stage]} --micro_batch {best['train_micro_batch_size_per_gpu']} "
             f"--grad_accum {best['gradient_accumulation_steps']}")
    grid = acc["grid_median"]
    picks = {"autotuner": tuner, "race": acc["pick"], "grid": acc["best"]}
    final = {who: [v for v in runs if v] for who, runs in h["final"].items()}
    finals = compact.iterdir(directory / "autotune" / "final") if compact.is_dir(directory / "autotune" / "final") else []
    peaks = {who: max((compact.read_json(f / "summary.json").get("mem_peak_bytes") or 0
                       for f in finals if fnmatch(f.name, f"{who}-r*") and compact.is_file(f / "summary.json")),
                      default=None)
             for who in final}
    plan_time = directory / "plan_time.json"
    return {"experiments": h["experiments"], "seconds": h["seconds"], "picks": picks,
            "regret": {who: 1 - grid[f] / grid[acc["best"]] for who, f in picks.items()},
            "final_median": {who: statistics.median(v) if v else None for who, v in final.items()},
            "final_range": {who: (min(v), max(v)) if v else None for who, v in final.items()},
            "final_peak_bytes": peaks,
            "plan_seconds": compact.read_json(plan_time)["seconds"] if compact.is_file(plan_time) else float("nan")}
