"""Many runs: sweeps, the runner that launches them, where they go (here or Slurm), launching, the
largest-batch search. One run is training/'s.

What the layers above use (analysis/, the planner) is here; the modules are this package's parts:

    run = SweepRun(name, backend, config_file, world_size, flags)  # flags: train.py's, as (name, value)
    outcome = run_one(run, directory, timeout_s)          # one run, launched and waited for: an Outcome
    outcomes = run_many(name, directory, timeout_s, runs) # a sweep's runs, here (or with slurm=, as jobs)

No torch here: a Slurm job's wrapper imports this package to unpickle its run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import orchestration.runner
from orchestration.executors import executor_for
from orchestration.launch import run_python
from orchestration.runner import TERMINATED, Outcome
from orchestration.slurm import add_flags, settings_from
from orchestration.sweep import SlurmSettings, SweepRun


def run_one(run: SweepRun, directory: Path, timeout_s: float) -> Outcome:
    """`run` launched through its real launcher into `directory` (its record there, its log in
    `directory`/.logs) and waited for, stopped after `timeout_s` seconds: its Outcome (`status`,
    `summary`, `line()`). A record of the same run already there (same flags, files and environment)
    is reused, not rerun, as a sweep reuses it; a record another process writes is left alone."""
    return orchestration.runner.Runner(Path(directory), timeout_s).run(run)


def run_many(name: str, directory: Path, timeout_s: float, runs: list[SweepRun],
             slurm: SlurmSettings | None = None,
             report: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> list[Outcome]:
    """`runs` as one sweep named `name` into `directory`, holding it meanwhile (ConfigError when another
    sweep has it, or a record there was made with other settings): one after another here, or with
    `slurm` one Slurm job each. Each run's Outcome, in order; `report(line)` says progress."""
    executor = executor_for(name, Path(directory), timeout_s, runs, slurm)
    lock = executor.hold_directory()
    try:
        executor.check()
        return executor.run_all(report)
    finally:
        lock.release()


__all__ = ["TERMINATED", "Outcome", "SlurmSettings", "SweepRun", "add_flags", "executor_for", "run_many", "run_one",
           "run_python", "settings_from"]
