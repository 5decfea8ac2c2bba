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

from training.launch import REPO, TRAIN, launch_command, launch_env  # noqa: F401 (TRAIN: for the tests)

SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
# A launch that takes longer than this is hung: fail fast instead of waiting for pytest's timeout.
LAUNCH_TIMEOUT_S = 240


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
    """A launch's environment (training/launch.py), one CPU thread per rank unless told otherwise."""
    env = launch_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def in_process(main, argv: list[str]) -> subprocess.CompletedProcess:
    """`main(argv)` of a CLI called in this process: what the process would exit with and print
    (the logic, without a new interpreter per case; each suite runs a few cases as processes too)."""
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(map(str, argv)))
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def train(runs_dir: Path, name: str, *args: str, launcher: str = "python", nproc: int = 2,
          timeout: float = LAUNCH_TIMEOUT_S, env: dict | None = None) -> Run:
    """Run train.py to completion (or failure) and return its record."""
    cmd = [*launch_command(launcher, nproc), "--runs_dir", str(runs_dir), "--run_name", name, "--quiet", *args]
    proc = subprocess.run(cmd, cwd=REPO, env={**base_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    return Run(proc, Path(runs_dir) / name)


# Small, fast and exact: no dropout, fp32, a learning rate that moves the weights from step 0.
PARITY_ARGS = ("--preset", "tiny", "--dropout", "0", "--precision", "fp32", "--lr_warmup_steps", "0",
               "--mem_profile_steps", "0", "--warmup_steps", "0", "--eval_batches", "1")


def assert_losses_close(actual: list[float], expected: list[float], steps: int, rtol: float) -> None:
    """Per-step losses of two runs agree within a relative tolerance, over all `steps` steps."""
    assert len(actual) == len(expected) == steps
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected))
    assert worst <= rtol, f"max relative deviation {worst:.2e} > {rtol:g}\n{actual}\n{expected}"


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"


REFERENCE_STEPS = 10


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory) -> Run:
    """The single-process reference every parity test compares against: PARITY_ARGS, micro-batch 8
    (global batch 8), REFERENCE_STEPS steps, the last one profiled for memory. Run once per session."""
    return train(tmp_path_factory.mktemp("reference"), "single", *PARITY_ARGS, "--steps", str(REFERENCE_STEPS),
                 "--micro_batch", "8", "--mem_profile_steps", "1").check_ok()


QUICK_SPEC = REPO / "sweeps" / "cpu_quick.yaml"


@pytest.fixture(scope="session")
def quick_sweep(tmp_path_factory) -> Path:
    """Every backend configuration of sweeps/cpu_quick.yaml, checkpointing off and on, run once
    through sweep.py (shortened to 3 steps) for the tests that compare many configurations."""
    import yaml

    spec = yaml.safe_load(QUICK_SPEC.read_text())
    directory = tmp_path_factory.mktemp("quick")
    spec.update(name="quick_test", steps=3, runs_dir=str(directory / "runs"))
    spec["train_args"] = {**spec.get("train_args", {}), "warmup_steps": 1, "mem_profile_steps": 1,
                          "eval_batches": 1}
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, str(REPO / "sweep.py"), str(path)], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return directory / "runs"
