"""Shared helpers: launching train.py the way users do, and reading what a run left behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestration.launch import REPO, TRAIN, launch_command, launch_env  # noqa: F401 (TRAIN: for the tests)

from launches import LAUNCH_TIMEOUT_S, PARITY_ARGS, REFERENCE_STEPS, Launched  # noqa: F401 (for the tests)
import forkserver  # noqa: E402

pytest_plugins = ["tiers"]  # tier markers, the unit tier's guard, the launch counts (tests/support/tiers.py)

# A run record names the checkout's commit (git, once per process) and the processor (platform runs
# `uname -p` once per process): read here, before any unit test, so the unit tests that run a record
# in this process start no process for them.
import platform  # noqa: E402

from core.environment import git_commit  # noqa: E402

git_commit()
platform.processor()

# The planner prices each configuration's own cost as measured on this machine and kept in
# $GPTLITE_CACHE/backend_costs.json (analysis/plan/backend_costs.py): a developer's kept figures
# would change what the tests' plans predict. The tests' plans see none (an empty file), and each test
# of the cache names its own. Nor the figures shipped for a machine's kind (analysis/plan/shipped_costs.json):
# the tests' plans would predict otherwise on the machines of those kinds than on the others.
os.environ["GPTLITE_BACKEND_COSTS"] = os.devnull
os.environ["GPTLITE_SHIPPED_COSTS"] = os.devnull

SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

@dataclass
class Run:
    """What one launch of train.py produced."""

    proc: subprocess.CompletedProcess
    dir: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())

    @property
    def config(self) -> dict:
        return json.loads((self.dir / "config.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.dir / "metrics.jsonl").read_text().splitlines()]

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    def check_ok(self) -> "Run":
        assert self.proc.returncode == 0, f"exit {self.proc.returncode}\n{self.proc.stdout}\n{self.proc.stderr}"
        assert self.summary["status"] == "ok", self.summary
        return self


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it. Launchers do not keep their ranks in their own
    process group (torchrun starts each rank in a session of its own), so killpg misses them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def kill_tree(root: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to a launcher and all its ranks at once."""
    for pid in process_tree(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def base_env() -> dict:
    """A launch's environment (orchestration/launch.py), one CPU thread per rank unless told otherwise."""
    env = launch_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def in_process(main, argv: list[str]) -> subprocess.CompletedProcess:
    """`main(argv)` of a CLI called in this process: what the process would exit with and print
    (the logic, without a new interpreter per case; each suite runs a few cases as processes too)."""
    import io

    # A CLI may install handlers (a sweep stops its run on SIGTERM, train.py records it): this
    # process keeps its own.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(map(str, argv)))
        except SystemExit as e:
            code = e.code
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def dry_run(flags: list[str], world: int) -> dict:
    """What `train.py --dry_run` prints as rank 0 of `world` ranks (a launcher's environment): train.py's
    main, in this process, under that environment (tests/unit/test_cli.py runs --dry_run as a process)."""
    import train
    from training.cli import build_parser, parse_args
    from training.run import main

    env = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world)} if world > 1 else {}
    saved = {name: os.environ.pop(name, None) for name in LAUNCHER_ENV}
    os.environ.update(env)
    try:
        parser = build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES)
        proc = in_process(lambda a: main(parse_args([*a, "--dry_run"], parser=parser)),
                          flags)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def tool_in_process(tool: str, argv: list[str]) -> subprocess.CompletedProcess:
    """train.py's or sweep.py's main, called in this process with argv (tests/unit/test_bad_input.py runs some
    cases as processes too)."""
    if tool == "train":
        import train
        from training.cli import build_parser, parse_args
        from training.run import main

        parser = build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES)
        return in_process(lambda a: main(parse_args(a, parser=parser)), argv)
    import sweep

    return in_process(sweep.main, argv)


def check_refused(proc, script: str, message: str, runs) -> None:
    """Bad input refused as the suite refuses it: exit 2, one line naming it, no traceback, nothing recorded."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{script}: error:") and message in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not any(json.loads(p.read_text()).get("status") == "ok" for p in runs.rglob("summary.json"))
    assert not list(runs.rglob("summary.json"))  # nothing recorded at all


_SERVER: list = []  # the test run's fork server (tests/support/forkserver.py), started by the first fork launch


def fork_server() -> str:
    """The fork server's socket, starting the server the first time (stopped by pytest_unconfigure).
    Launch commands started by what the test starts (a sweep's runner) find it through the environment."""
    if not _SERVER:
        import tempfile

        _SERVER.append(forkserver.Server(tempfile.mkdtemp(prefix="gptlite-forkserver-"), base_env()))
    path = _SERVER[0].socket()
    os.environ[forkserver.SOCKET_ENV] = path
    return path


def pytest_sessionstart(session):
    """matplotlib's font list built before any test runs: built on first use, it runs fc-list where
    fontconfig is installed, and a unit test's first figure (the plan's --out) would start a process
    (tests/support/tiers.py refuses it) on any machine without matplotlib's cache yet."""
    with contextlib.suppress(ImportError):
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import font_manager

        font_manager.fontManager  # noqa: B018 (loads or builds the cache)


def pytest_unconfigure(config):
    if _SERVER:
        _SERVER[0].stop()


def fork_command(launcher: str, nproc: int, script: Path = TRAIN, *args) -> list[str]:
    """launch_command's fork-launcher twin: the ranks of `launcher` forked from the fork server."""
    fork_server()
    return [sys.executable, str(Path(forkserver.__file__)), "launch", "--launcher", launcher,
            "--nproc", str(1 if launcher == "python" else nproc), str(script), *map(str, args)]


def fork_run_python(*args) -> subprocess.CompletedProcess:
    """orchestration.launch.run_python's fork-launcher twin."""
    return python(*args)


def _popen(command, **kwargs):
    """subprocess.Popen, except a fork launch command: its ranks forked from this process, without the
    command's interpreter (forkserver.Forked)."""
    if forkserver.is_launch_command(command) and not kwargs.get("preexec_fn"):
        return forkserver.Forked(command, **{k: v for k, v in kwargs.items() if k != "preexec_fn"})
    return subprocess.Popen(command, **kwargs)


# What orchestration/runner.py sees as `subprocess` under the fork launcher (forked_runs).
RUNNER_SUBPROCESS = type("subprocess", (), {"Popen": staticmethod(_popen), "STDOUT": subprocess.STDOUT,
                                            "TimeoutExpired": subprocess.TimeoutExpired})


@contextlib.contextmanager
def forked_runs():
    """A sweep's or the planner's runs (orchestration/runner.py) launched by the fork launcher, as
    forked_launchers and launches.sweep_forked ask: each run's command is a fork launch command
    (conftest.fork_command), which the runner starts without an interpreter for it."""
    import orchestration.launch
    import orchestration.runner
    import orchestration.sweep
    from unittest import mock

    fork_server()
    with mock.patch.object(orchestration.sweep, "launch_command", fork_command), \
            mock.patch.object(orchestration.launch, "run_python", fork_run_python), \
            mock.patch.object(orchestration.runner, "subprocess", RUNNER_SUBPROCESS):
        yield


@pytest.fixture
def forked_launchers(monkeypatch):
    """What a CLI called in this process launches (a sweep's or the planner's runs, the projection's
    fake-world counts) forked from the fork server: its own logic as it is, each run without its
    start-up."""
    for name, value in base_env().items():  # the environment the CLI would have been started with
        monkeypatch.setenv(name, value)
    with forked_runs():
        yield


def python(*args, env: dict | None = None, timeout: float = LAUNCH_TIMEOUT_S, real: bool = False,
           cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python ARGS` (a script or `-m MODULE`, then its arguments) to completion: forked from the
    fork server, or a real interpreter with `real` (where starting one is what the test checks)."""
    args = [str(a) for a in args]
    if real:
        return subprocess.run([sys.executable, *args], cwd=cwd, env={**base_env(), **(env or {})},
                              capture_output=True, text=True, timeout=timeout)
    script = args[:2] if args[0] == "-m" else args[:1]
    return launch(Path(script[-1]) if len(script) == 1 else script, args[len(script):], "python", 1, timeout,
                  env, cwd=cwd)


def launch(script, args: list[str], launcher: str = "python", nproc: int = 2, timeout: float = LAUNCH_TIMEOUT_S,
           env: dict | None = None, real: bool = False, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`script args` under `launcher` on `nproc` ranks, to completion: the real launcher with `real`,
    else forked from the fork server (tests/support/forkserver.py: the same ranks without their start-up).
    `script`: a path, or ["-m", MODULE]."""
    env = {**base_env(), **(env or {})}
    if real or launcher not in forkserver.LAUNCHERS:
        return subprocess.run([*launch_command(launcher, nproc, script), *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    import tempfile

    argv = [*(script if isinstance(script, list) else [str(script)]), *map(str, args)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            code = forkserver.launch(argv, launcher, 1 if launcher == "python" else nproc, env=env, cwd=str(cwd),
                                     stdout=out.fileno(), stderr=err.fileno(), timeout=timeout,
                                     socket_path=fork_server())
        except TimeoutError:
            out.seek(0), err.seek(0)
            raise subprocess.TimeoutExpired(argv, timeout, out.read(), err.read()) from None
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess([f"fork:{launcher}", *argv], code, out.read(), err.read())


def train(runs_dir: Path, name: str, *args: str, launcher: str = "python", nproc: int = 2,
          timeout: float = LAUNCH_TIMEOUT_S, env: dict | None = None, real: bool = False) -> Run:
    """Run train.py to completion (or failure) and return its record: forked from the fork server,
    or under the real launcher with `real` (where the launcher is what the test is about)."""
    proc = launch(TRAIN, ["--runs_dir", str(runs_dir), "--run_name", name, "--quiet", *args], launcher=launcher,
                  nproc=nproc, timeout=timeout, env=env, real=real)
    return Run(proc, Path(runs_dir) / name)


def assert_losses_close(actual: list[float], expected: list[float], steps: int, rtol: float) -> None:
    """Per-step losses of two runs agree within a relative tolerance, over all `steps` steps."""
    assert len(actual) == len(expected) == steps
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected))
    assert worst <= rtol, f"max relative deviation {worst:.2e} > {rtol:g}\n{actual}\n{expected}"


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"


@pytest.fixture(scope="session")
def launches(tmp_path_factory) -> Launched:
    """The real launches of tests/support/launches.py's table, each made once per test run, when a test first
    reads it: `launches.get(name, request)`. Under pytest-xdist the workers of a run share them (in
    the directory above each worker's own)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "launches"
        root.mkdir(exist_ok=True)
        return Launched(root)
    return Launched(tmp_path_factory.mktemp("launches"))


def record(directory: Path) -> Run:
    """A record made by a launch the test did not start itself (a sweep's run)."""
    return Run(subprocess.CompletedProcess([], 0, "", ""), Path(directory))


def matrix_run(runs: Path, label: str, ckpt: int = 0) -> Run:
    """The quick matrix's record (launches "matrix") of a configuration label (single, ddp,
    fsdp.full_shard, deepspeed.z3, ...), checkpointing off or every block."""
    # single stands in for the 2 ranks: one process, micro-batch 4 accumulated twice (orchestration/sweep.py)
    shape = "w1-tiny-mb4x2" if label == "single" else "w2-tiny-mb4"
    suffix = "-ckpt1-torch_nonreentrant" if ckpt else "-ckpt0"
    return record(runs / f"{label}-{shape}-fp32{suffix}").check_ok()
