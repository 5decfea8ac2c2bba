#!/usr/bin/env python
"""Run a matrix of training runs from a YAML spec, one at a time, through the real launchers.

    python sweep.py sweeps/cpu_quick.yaml              # every run of the matrix
    python sweep.py sweeps/cpu_quick.yaml --dry_run    # list the runs and their commands
    python sweep.py sweeps/cpu_quick.yaml --max_batch --mem_budget_gb 2   # largest micro-batch per config
    python -m analysis.report runs/sweeps/cpu_quick --out reports/cpu_quick
    python sweep.py sweeps/cpu_slurm.yaml --executor slurm    # one Slurm job per run (submitit)
    python sweep.py sweeps/cpu_slurm.yaml --status            # queued, running, ok, failed, ...
    python sweep.py sweeps/cpu_slurm.yaml --cancel

The command line lives in orchestration/cli.py: this file is only what users run.
"""

import sys

from orchestration.cli import main

if __name__ == "__main__":
    sys.exit(main())
