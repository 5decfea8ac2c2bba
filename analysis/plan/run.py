"""How the planner runs its candidates: the one place it calls the sweep's runner and executors
(training/runner.py, training/executors.py), each candidate's flags turned into a run there, once."""

from __future__ import annotations

import sys
from pathlib import Path

import training.runner
from gptlite.errors import ConfigError
from training.executors import executor_for
from training.sweep import PlannedRun
from analysis.plan.candidates import Candidate


def flag_pairs(argv: list[str]) -> tuple[tuple[str, object], ...]:
    """train.py's flags as (name, value) pairs, a switch's value True (training/sweep.PlannedRun.flags)."""
    pairs, i = [], 0
    while i < len(argv):
        name = argv[i]
        if not name.startswith("--"):
            raise ConfigError(f"{name}: expected a --flag")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((name[2:], argv[i + 1]))
            i += 2
        else:
            pairs.append((name[2:], True))
            i += 1
    return tuple(pairs)


def short_run(name: str, cand: Candidate, backend: str, world: int, train_argv: list[str], steps: int) -> PlannedRun:
    """The candidate as a run of `steps` steps (2 warm-up, the last profiled for memory) named `name`:
    its argv made here, where it is launched."""
    pairs = flag_pairs([*train_argv, *cand.flags()[2:], "--steps", str(steps), "--warmup_steps", "2",
                        "--mem_profile_steps", "1", "--eval_batches", "1"])
    return PlannedRun(name, backend, cand.file, world, pairs)


def run_candidates(prefix: str, runs_dir: Path, timeout_s: float, runs: list[PlannedRun], slurm=None) -> list:
    """`runs` through the sweep's executor (here one after another, or as Slurm jobs with `slurm`), as
    ordinary records under `runs_dir` holding it for the time (a record of the same run there is
    reused), a progress line each: their outcomes, in order."""
    executor = executor_for(prefix, runs_dir, timeout_s, runs, slurm)
    lock = executor.hold_directory()
    try:
        executor.check()
        return executor.run_all(lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        lock.release()


def run_one(planned: PlannedRun, directory: Path, timeout_s: float):
    """One run launched into `directory` (the probe's scratch one) and waited for, within `timeout_s`:
    its outcome (status, summary, line())."""
    return training.runner.Runner(directory, timeout_s).run(planned)
