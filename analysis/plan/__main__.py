"""python -m analysis.plan: the planner's command line is analysis/plan/cli.py (main)."""

import sys

from analysis.plan.cli import main

sys.exit(main())
