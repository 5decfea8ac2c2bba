"""Several one-process train.py runs in one interpreter, one after another: train.py's own main on
each argument list, as `python train.py ARGS` would run it (the allocator pinned first, as train.py
does), for reference runs that several tests compare against. One launch instead of one per run;
the runs whose launch is what a test checks are launched on their own.

    python tests/support/run_many.py RUNS.json      # a list of train.py argument lists; exits 1 if any failed
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from core.allocator import keep_freed_memory  # noqa: E402

keep_freed_memory()  # before torch allocates anything, as train.py

import train  # noqa: E402
from training.cli import build_parser, parse_args  # noqa: E402
from training.run import main  # noqa: E402


def run_all(runs: list[list[str]]) -> int:
    parser = build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES)
    codes = [main(parse_args(argv, parser=parser)) for argv in runs]
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(run_all(json.loads(Path(sys.argv[1]).read_text())))
