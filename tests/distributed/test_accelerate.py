"""accelerate: `accelerate launch` as the launcher of the torch backends, and the `accelerate`
backend (Accelerator) matching the single-process reference."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LAUNCH_TIMEOUT_S, PARITY_ARGS, REPO, TRAIN, Run, assert_losses_close, base_env, train
from core.ports import free_port
from launches import committed_reference

STEPS = 6
RTOL = 1e-5
ACCELERATE_CONFIG = REPO / "accelerate_configs" / "cpu_2proc.yaml"


def accelerate_launch(runs_dir: Path, name: str, *args: str) -> Run:
    accelerate = Path(sys.executable).parent / "accelerate"
    if not accelerate.exists():
        accelerate = Path(shutil.which("accelerate") or "accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(ACCELERATE_CONFIG), "--main_process_port",
           str(free_port()), str(TRAIN), "--runs_dir", str(runs_dir), "--run_name", name, "--quiet", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return Run(proc, Path(runs_dir) / name)


@pytest.fixture
def reference():
    """The reference's first STEPS steps (committed: tests/support/reference_losses.json)."""
    return committed_reference()["losses"][:STEPS]


ARGS = (*PARITY_ARGS, "--steps", str(STEPS), "--micro_batch", "4")


@pytest.mark.distributed
def test_accelerate_launch_starts_the_torch_backends(runs_dir, reference):
    run = accelerate_launch(runs_dir, "ddp", *ARGS, "--backend", "ddp").check_ok()
    assert run.config["launcher"] == "accelerate" and run.summary["world_size"] == 2
    assert_losses_close(run.losses, reference, STEPS, RTOL)


@pytest.mark.distributed
def test_accelerate_backend_under_accelerate_launch_matches_single(runs_dir, reference):
    run = accelerate_launch(runs_dir, "acc", *ARGS, "--backend", "accelerate", "--grad_accum", "1").check_ok()
    assert run.config["launcher"] == "accelerate"
    backend = run.config["backend"]
    assert backend["accelerate_plugin"] == "none" and backend["wrapper"] == "DistributedDataParallel"
    assert_losses_close(run.losses, reference, STEPS, RTOL)


@pytest.mark.distributed
def test_accelerate_backend_under_torchrun_with_accumulation_matches_single(runs_dir, reference):
    # accelerate divides the loss by its gradient_accumulation_steps and skips the all-reduce on
    # non-final micro-steps itself: 2 ranks x 2 micro x 2 steps = the reference's batch of 8.
    run = train(runs_dir, "acc-accum", *PARITY_ARGS, "--steps", str(STEPS), "--backend", "accelerate",
                "--micro_batch", "2", "--grad_accum", "2", launcher="torchrun").check_ok()
    assert run.config["launcher"] == "torchrun" and run.summary["global_batch"] == 8
    assert_losses_close(run.losses, reference, STEPS, RTOL)


@pytest.mark.distributed
def test_bad_input_under_accelerate_launch_is_said_once(runs_dir):
    proc = subprocess.run([str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
                           str(ACCELERATE_CONFIG), "--main_process_port", str(free_port()), str(TRAIN), "--runs_dir",
                           str(runs_dir), "--backend", "ddp", "--steps", "-3"], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode != 0
    assert proc.stderr.count("train.py: error: steps must be >= 1 (got -3)") == 1, proc.stderr
    assert not runs_dir.exists()
