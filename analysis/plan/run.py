"""How the planner runs its candidates: the one place it calls orchestration (run_one, run_many), each
candidate's flags turned into a run there, once."""

from __future__ import annotations

from pathlib import Path

import orchestration
from gptlite.errors import ConfigError
from orchestration import SweepRun
from analysis.plan.candidates import Candidate


def flag_pairs(argv: list[str]) -> tuple[tuple[str, object], ...]:
    """train.py's flags as (name, value) pairs, a switch's value True (orchestration/sweep.SweepRun.flags)."""
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


def short_run(name: str, cand: Candidate, backend: str, world: int, train_argv: list[str], steps: int) -> SweepRun:
    """The candidate as a run of `steps` steps (2 warm-up, the last profiled for memory) named `name`:
    its argv made here, where it is launched."""
    pairs = flag_pairs([*train_argv, *cand.flags()[2:], "--steps", str(steps), "--warmup_steps", "2",
                        "--mem_profile_steps", "1", "--eval_batches", "1"])
    return SweepRun(name, backend, cand.file, world, pairs)


def run_candidates(prefix: str, runs_dir: Path, timeout_s: float, runs: list[SweepRun], slurm=None) -> list:
    """`runs` as one sweep (orchestration.run_many: here one after another, or as Slurm jobs with
    `slurm`), ordinary records under `runs_dir` (a record of the same run there is reused), a progress
    line each: their outcomes, in order."""
    return orchestration.run_many(prefix, runs_dir, timeout_s, runs, slurm)


def run_one(planned: SweepRun, directory: Path, timeout_s: float):
    """One run launched into `directory` (the probe's scratch one) and waited for, within `timeout_s`:
    its outcome (status, summary, line()): orchestration.run_one."""
    return orchestration.run_one(planned, directory, timeout_s)
