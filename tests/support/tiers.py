"""The suite's tiers, and what each test started (a pytest plugin, loaded by conftest.py).

Every test belongs to exactly one tier, by marker (declared in pyproject.toml):

    unit         no process at all: the logic, in this process (the default: a test with no tier marker)
    launch       one-process train.py runs or CLI subprocesses
    distributed  real multi-rank launches: torchrun, deepspeed, accelerate (and what reads their records)
    slurm        the real local Slurm (tools/slurm_local.sh), started by the tests
    gpu          needs a CUDA device; skipped, saying so, where there is none

A unit test that starts a process fails (the guard below), so the tier a test claims is the tier it
is. `make test-fast` runs `-m unit`; `make test` runs them all.

What the suite starts is counted by the suite itself: every Python interpreter started under it
(launchers, ranks, CLIs, sweeps' runs, Slurm jobs) runs tests/support/launch_counter/sitecustomize.py,
which appends a line to the file GPTLITE_TEST_LAUNCH_LOG names; each test is charged the lines
that appeared while it (and the fixtures it set up) ran. Ranks forked by the fork launcher
(tests/support/forkserver.py) start no interpreter: each adds a "[fork]" line, counted apart. The end of the
run prints, per tier, the tests, their time and the interpreters, forks and commands they started.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

TIERS = ("unit", "launch", "distributed", "slurm", "gpu")
SLOWEST_FIRST = ("slurm", "distributed", "launch", "unit", "gpu")
COUNTER = Path(__file__).resolve().parent / "launch_counter"
LOG_ENV = "GPTLITE_TEST_LAUNCH_LOG"
REPORT_ENV = "GPTLITE_TEST_REPORT"  # a file to write each test's tier, outcome, seconds and launches to


class StartedAProcess(RuntimeError):
    """A unit-tier test started a process."""


_state = {"unit": None, "commands": 0}


def _refuse(what: str) -> None:
    test = _state["unit"]
    if test is not None:
        raise StartedAProcess(f"{test} is a unit test (no tier marker) but started a process ({what}); "
                              "mark it launch, distributed or slurm (tests/support/tiers.py), or keep it in-process")


def _audit(event: str, args) -> None:
    if event == "subprocess.Popen":
        _state["commands"] += 1
        _refuse(" ".join(map(str, (args[1] or [args[0]])[:4])))
    elif event in ("os.system", "os.posix_spawn", "os.exec", "os.spawn", "os.fork", "os.forkpty"):
        _refuse(event)


def _guard_fork_exec() -> None:
    """multiprocessing's spawn starts its children through _posixsubprocess.fork_exec directly (no audit
    event): the guard wraps it too."""
    try:
        import _posixsubprocess
    except ImportError:  # not POSIX: the audit events still guard subprocess
        return
    real = _posixsubprocess.fork_exec

    def fork_exec(*args, **kwargs):
        _refuse("multiprocessing or a raw fork_exec")
        return real(*args, **kwargs)

    _posixsubprocess.fork_exec = fork_exec


def tier_of(item) -> str:
    found = {m.name for m in item.iter_markers() if m.name in TIERS}
    if len(found) > 1:
        raise pytest.UsageError(f"{item.nodeid}: more than one tier marker ({', '.join(sorted(found))}); "
                                "a test belongs to one tier (tests/support/tiers.py)")
    return found.pop() if found else "unit"


def _launch_lines() -> tuple[int, int]:
    """(interpreters, forks) in the launch log so far: forks are the ranks tests/support/forkserver.py forked."""
    try:
        with open(os.environ[LOG_ENV], "rb") as f:
            lines = f.read().splitlines()
    except (KeyError, FileNotFoundError):
        return 0, 0
    forks = sum(1 for line in lines if b" [fork] " in line)
    return len(lines) - forks, forks


class Tiers:
    """The plugin object: collection (tier markers), the guard, the counts and the summary."""

    def __init__(self):
        self.rows: dict[str, dict] = {}
        self.started = time.monotonic()

    def pytest_configure(self, config):
        log_dir = Path(tempfile.mkdtemp(prefix="gptlite-tests-"))
        os.environ[LOG_ENV] = str(log_dir / "launches.log")
        # Every interpreter started below this one imports the counter (orchestration.launch.launch_env keeps
        # the PYTHONPATH it is given, after the repository).
        paths = [str(COUNTER), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        sys.addaudithook(_audit)
        _guard_fork_exec()

    def pytest_collection_modifyitems(self, config, items):
        for item in items:
            tier = tier_of(item)
            if tier == "unit" and not item.get_closest_marker("unit"):
                item.add_marker(pytest.mark.unit)
            item.stash[TIER] = tier
        # Modules with the slowest tiers first, each module's tests together and in their order: the
        # workers (make test: pytest-xdist, a module to a worker) start on the long modules and end on
        # short ones, instead of one worker finishing the Slurm tests alone while the other waits.
        rank = {}
        for item in items:
            module = item.nodeid.split("::")[0]
            rank[module] = min(rank.get(module, len(TIERS)), SLOWEST_FIRST.index(item.stash[TIER]))
        items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: the order within a rank stays

    def pytest_runtest_setup(self, item):
        if item.stash[TIER] == "gpu":
            import torch

            if not torch.cuda.is_available():
                pytest.skip("gpu tier: no CUDA device on this machine (torch.cuda.is_available() is False)")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        item.stash[STARTED] = (*_launch_lines(), _state["commands"], time.monotonic())
        _state["unit"] = item.nodeid if item.stash[TIER] == "unit" else None
        try:
            yield
        finally:
            _state["unit"] = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        # Fixtures of a wider scope end in the teardown of the last test that used their scope, whatever
        # its tier (the local Slurm is stopped after the session's last test): the guard covers a unit
        # test's setup and call.
        _state["unit"] = None
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """The test's row (tier, seconds, what it started), on its teardown's report: the process that
        reports the run (the controller, under pytest-xdist) reads it there."""
        outcome = yield
        if call.when == "teardown" and STARTED in item.stash:
            interpreters, forks, commands, t0 = item.stash[STARTED]
            now = _launch_lines()
            row = dict(tier=item.stash[TIER], seconds=time.monotonic() - t0, interpreters=now[0] - interpreters,
                       forks=now[1] - forks, commands=_state["commands"] - commands)
            outcome.get_result().user_properties.append((ROW, row))

    def pytest_runtest_logreport(self, report):
        row = self.rows.setdefault(report.nodeid, {"outcome": "passed"})
        if report.failed:
            row["outcome"] = "failed"
        elif report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"
        for key, value in report.user_properties:
            if key == ROW:
                row.update(value)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.rows or hasattr(terminalreporter.config, "workerinput"):  # a pytest-xdist worker: the controller sums
            return
        totals = defaultdict(lambda: defaultdict(float))
        for row in self.rows.values():
            if "tier" not in row:
                continue
            for tier in (row["tier"], "all"):
                t = totals[tier]
                t["tests"] += 1
                t[row["outcome"]] += 1
                for key in ("seconds", "interpreters", "forks", "commands"):
                    t[key] += row.get(key, 0)
        write = terminalreporter.write_line
        terminalreporter.section("tiers: tests, time and processes started (tests/support/tiers.py)")
        write(f"{'tier':<12} {'tests':>6} {'passed':>7} {'failed':>7} {'skipped':>8} {'seconds':>9} "
              f"{'interpreters':>13} {'forks':>6} {'commands':>9}")
        for tier in (*TIERS, "all"):
            if tier in totals:
                t = totals[tier]
                write(f"{tier:<12} {int(t['tests']):>6} {int(t['passed']):>7} {int(t['failed']):>7} "
                      f"{int(t['skipped']):>8} {t['seconds']:>9.1f} {int(t['interpreters']):>13} "
                      f"{int(t['forks']):>6} {int(t['commands']):>9}")
        workers = getattr(terminalreporter.config.option, "numprocesses", None)
        write(f"wall clock: {time.monotonic() - self.started:.1f} s"
              + (f" ({workers} pytest-xdist workers: a tier's seconds add its tests' own, side by side)"
                 if workers else ""))
        write("interpreters: Python processes started under the test (launchers, ranks, CLIs, sweeps' runs, "
              "Slurm jobs); forks: ranks forked by the fork launcher (tests/support/forkserver.py); commands: processes "
              "the test process itself started")
        if os.environ.get(REPORT_ENV):  # every test's row, for comparing two runs of the suite
            import json

            Path(os.environ[REPORT_ENV]).write_text(json.dumps(self.rows, indent=1))
            write(f"each test's row: {os.environ[REPORT_ENV]}")


TIER = pytest.StashKey[str]()
STARTED = pytest.StashKey[tuple]()
ROW = "gptlite-tier-row"


def pytest_configure(config):
    config.pluginmanager.register(Tiers(), "gptlite-tiers")
