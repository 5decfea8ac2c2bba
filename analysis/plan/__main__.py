"""python -m analysis.plan (analysis/plan/__init__.py main)."""

import sys

from analysis.plan import main

sys.exit(main())
