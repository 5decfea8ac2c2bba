"""Where a sweep's runs go, behind one interface: this machine, one run after another
(orchestration/runner.LocalSweep), or one Slurm job each (orchestration/slurm.SlurmSweep).

    executor = executor_for(name, directory, timeout_s, runs, slurm=None)  # SlurmSettings for Slurm
    executor.check()                 # ConfigError: a record made with other settings, or what Slurm refuses
    lock = executor.hold_directory() # one sweep per directory (ConfigError naming the other)
    outcomes = executor.run_all(report)  # every run's Outcome, in order; report(line) says progress

sweep.py and the planner's verification (analysis/plan/verify.py) both go through it.
"""

from __future__ import annotations

from pathlib import Path

from orchestration.runner import LocalSweep
from orchestration.slurm import SlurmSweep


def executor_for(name: str, directory: Path, timeout_s: float, runs, slurm=None, retry_failed: bool = False):
    """LocalSweep, or with `slurm` (orchestration/sweep.SlurmSettings) SlurmSweep, for `runs` into `directory`."""
    if slurm is None:
        return LocalSweep(name, directory, timeout_s, runs, retry_failed=retry_failed)
    return SlurmSweep(name, directory, timeout_s, runs, slurm, retry_failed=retry_failed)
