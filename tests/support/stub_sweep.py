"""sweep.py with tests/support/stub_run.py as every run's command (the runner's behaviour, without a launch
per run): `python tests/support/stub_sweep.py SPEC [sweep.py's flags]`, for the tests that signal a sweep
process itself. In-process tests patch the command the same way (stub_command)."""

from __future__ import annotations

import sys
from pathlib import Path

STUB = Path(__file__).resolve().parent / "stub_run.py"
sys.path.insert(0, str(STUB.parents[2]))  # the repository


def stub_command(self, runs_dir) -> list[str]:
    """SweepRun.command's stand-in: the stub, with the run's own train.py flags."""
    return [sys.executable, str(STUB), *self.argv(runs_dir)]


if __name__ == "__main__":
    import sweep
    from orchestration.sweep import SweepRun

    SweepRun.command = stub_command
    sys.exit(sweep.main(sys.argv[1:]))
