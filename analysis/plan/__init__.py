"""The planner: which configuration to train a model with on W ranks under a memory budget per rank.

    python -m analysis.plan --world 2 --gpu here --mem_budget_gb 0.3 --global_batch 16 --preset small

Its command line, and how it prices a candidate, is analysis/plan/cli.py (`python -m analysis.plan --help`).
The parts: candidates.py (the configurations, micro-batches and checkpointing searched: each a Candidate,
whose RunConfig is the model's with the candidate's choices), cost.py (each candidate resolved as train.py
resolves it, its peak estimated, its step priced, ranked), device.py (the device priced on: a named GPU, or
this machine calibrated), backend_costs.py and probe.py (each configuration's own cost on this machine),
run.py (the one place the planner runs candidates), verify.py (--verify and --race), refit.py (the step
model refitted on the runs), report.py (what a plan prints and writes).
"""

from __future__ import annotations

from analysis.plan.candidates import (CHOSEN_FLAGS, CKPT, Candidate, GiB, MARGIN, RUN_OWN_FLAGS,  # noqa: F401
                                      _check_ckpt_within_blocks, _check_config, candidates, configurations, variants,
                                      write_variants)
from analysis.plan.device import (CALIBRATION_LINE, Device, Link, calibrate, calibration_line,  # noqa: F401
                                  calibration_points, here_device, named_device, probe_link)
from analysis.plan.cost import command, evaluate, plan, rank, resolve_candidate  # noqa: F401
from analysis.plan.run import flag_pairs, run_candidates, run_one  # noqa: F401
from analysis.plan.verify import (RACE_LEAST, RACE_WITHIN, SLURM_OWN, _measured, entrants, race,  # noqa: F401
                                  to_verify, verify)
from analysis.plan.refit import refit, replay  # noqa: F401
from analysis.plan.report import _ties, frontier, write_out  # noqa: F401
from analysis.plan.cli import main  # noqa: F401
