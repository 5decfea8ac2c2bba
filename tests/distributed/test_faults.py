"""Failures: a rank killed, runs killed at random moments, out of memory on one rank."""

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PARITY_ARGS, REPO, base_env, kill_tree, launch_command, process_tree, train

pytestmark = pytest.mark.distributed
TIMEOUT_S = 30  # --dist_timeout_s of these runs


def _start(launcher, runs_dir, name, *args, env=None):
    cmd = [*launch_command(launcher, 2), "--runs_dir", str(runs_dir), "--run_name", name, "--quiet",
           "--dist_timeout_s", str(TIMEOUT_S), *PARITY_ARGS, *args]
    return subprocess.Popen(cmd, cwd=REPO, env={**base_env(), **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _rank_pid(proc, rank: int) -> int:
    """The pid of the worker with RANK=rank among the launcher's descendants."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for pid in process_tree(proc.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and any(v.startswith(b"LOCAL_RANK=") for v in environ):
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} worker found")


def _wait_for_training(run_dir: Path, proc):
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.1)


@pytest.mark.parametrize("launcher, backend_args", [
    ("torchrun", ("--backend", "ddp", "--micro_batch", "2")),
    ("deepspeed", ("--deepspeed_config", "ds_configs/z2.json", "--micro_batch", "2")),
])
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_fails_the_run_quickly_with_a_reason(tmp_path, launcher, backend_args, victim):
    proc = _start(launcher, tmp_path, "killed", *backend_args, "--steps", "100000")
    try:
        _wait_for_training(tmp_path / "killed", proc)
        os.kill(_rank_pid(proc, victim), signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=TIMEOUT_S + 30)
        elapsed = time.monotonic() - killed_at
    finally:
        kill_tree(proc.pid)  # whatever is left
    print(f"\n{launcher}: rank {victim} SIGKILLed, launcher exited {proc.returncode} after {elapsed:.1f} s")
    assert proc.returncode != 0 and elapsed < TIMEOUT_S + 30
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"], summary
    # The rank that died and its signal, not a survivor's broken connection (core/peers.py).
    assert summary["error"].startswith(f"rank {victim}: killed by SIGKILL"), summary["error"]


def test_runs_killed_at_random_moments_never_leave_truncated_json(tmp_path):
    rng = random.Random(os.getpid())
    for attempt in range(6):  # three under each launcher, each at its own random moment
        name = f"k{attempt}"
        launcher, backend = (("python", ()) if attempt % 2 else ("torchrun", ("--backend", "ddp", "--micro_batch", "2")))
        proc = _start(launcher, tmp_path, name, *backend, "--steps", "100000", "--save_dir", str(tmp_path / "ck" / name),
                      "--save_every", "3", env={"GPTLITE_METRICS_FLUSH_S": "0"})
        try:
            # Any moment: during start-up, while writing the config, while training and saving.
            time.sleep(rng.uniform(2.0, 9.0))
        finally:
            kill_tree(proc.pid)  # the launcher and every rank at once, as a machine losing power would
            proc.wait(timeout=60)
        files = [p for d in (tmp_path / name, tmp_path / "ck" / name) if d.exists() for p in d.rglob("*") if p.is_file()]
        for path in files:
            if path.name.startswith("."):  # a temporary that was never renamed into place
                assert re.fullmatch(r"\.([a-z0-9_.]+\.jsonl?|latest)\.\w+\.tmp", path.name), path
            elif path.name == "latest":  # the pointer names a checkpoint that finished writing
                assert path.read_text().endswith("\n"), path
                json.loads((path.parent / path.read_text().strip() / "meta.json").read_text())
            elif path.suffix == ".jsonl":
                assert path.read_text().endswith("\n") or not path.read_text()
                [json.loads(line) for line in path.read_text().splitlines()]
            elif path.suffix == ".json":
                json.loads(path.read_text())
        summary = tmp_path / name / "summary.json"
        if summary.exists():
            assert json.loads(summary.read_text())["status"] != "ok"


def test_out_of_memory_on_one_rank_reaches_every_rank(tmp_path):
    started = time.monotonic()
    run = train(tmp_path, "oom", *PARITY_ARGS, "--backend", "ddp", "--micro_batch", "2", "--steps", "20",
                "--dist_timeout_s", str(TIMEOUT_S), launcher="torchrun",
                env={"GPTLITE_FAULT": "kind=oom,step=3,rank=1"})
    assert run.proc.returncode != 0 and time.monotonic() - started < TIMEOUT_S + 60  # no hang
    assert run.summary["status"] == "oom" and run.summary["error"].startswith("rank 1: OutOfMemoryError")
    errors = sorted((tmp_path / "oom" / "errors").glob("rank*.json"))
    assert [p.name for p in errors] == ["rank0.json", "rank1.json"]  # it reached rank 0, which stopped too


def test_a_cpu_memory_budget_breach_is_oom_on_every_rank(tmp_path):
    run = train(tmp_path, "budget", *PARITY_ARGS, "--backend", "ddp", "--micro_batch", "2", "--steps", "3",
                "--mem_profile_steps", "1", "--mem_budget_gb", "0.001", launcher="torchrun")
    assert run.proc.returncode != 0 and run.summary["status"] == "oom"
    assert "MemoryBudgetExceeded" in run.summary["error"] and run.summary["mem_peak_bytes"] > 0.001 * 2**30
    # The ranks report it in one line; the only traceback is torchrun's own ChildFailedError report.
    ours = re.compile(rf'File "{re.escape(str(REPO))}/(training|backends|gptlite|train\.py)')
    assert not ours.search(run.proc.stderr), run.proc.stderr
