"""train.py's command line: bad input fails in one line with exit code 2; --dry_run; --help."""

import json
import subprocess
import sys
from dataclasses import fields


import pytest

from conftest import REPO, TRAIN, base_env
from core.config import RunConfig



def _train(*args, cwd=REPO):
    """train.py as a process: its exit code and what it prints."""
    return subprocess.run([sys.executable, str(TRAIN), *args], cwd=cwd, env=base_env(), capture_output=True,
                          text=True, timeout=120)


def _train_here(*args):
    """train.py's main in this process (the same parser and checks; the two tests marked launch run
    the script itself)."""
    import train
    from conftest import in_process
    from training.cli import build_parser, parse_args
    from training.run import main

    parser = build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES)
    return in_process(lambda a: main(parse_args(a, parser=parser)), args)


def test_unknown_backend_error_lists_the_allowed_ones(tmp_path):
    proc = _train_here("--backend", "horovod", "--runs_dir", str(tmp_path))
    assert "single" in proc.stderr and "ddp" in proc.stderr


@pytest.mark.launch
def test_dry_run_prints_resolved_config_with_n_params_and_trains_nothing(tmp_path):
    proc = _train("--dry_run", "--preset", "paper", "--micro_batch", "2", "--grad_accum", "3",
                  "--runs_dir", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout)
    assert resolved["n_params"] == 86_701_056
    assert resolved["global_batch"] == 6
    assert resolved["model"]["n_layer"] == 12 and resolved["data"]["vocab_size"] == 65
    assert not (tmp_path / "runs").exists()


@pytest.mark.launch
def test_help_explains_every_flag():
    proc = _train("--help")
    assert proc.returncode == 0
    for f in fields(RunConfig):
        assert f"--{f.name}" in proc.stdout, f.name
    assert "ddp" in proc.stdout and "single" in proc.stdout


def test_existing_run_name_is_refused_without_overwrite(tmp_path):
    (tmp_path / "taken").mkdir()
    proc = _train_here("--runs_dir", str(tmp_path), "--run_name", "taken")
    assert proc.returncode == 2 and "--overwrite" in proc.stderr and "Traceback" not in proc.stderr


def test_the_articles_flag_name_sets_the_checkpoint_interval(tmp_path):
    proc = _train_here("--dry_run", "--preset", "tiny", "--activation_checkpoint_interval", "2",
                  "--runs_dir", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["run"]["ckpt_interval"] == 2


def test_dry_run_records_the_backends_plan(tmp_path):
    proc = _train_here("--dry_run", "--preset", "tiny", "--fsdp_config", "fsdp_configs/full_shard.yaml",
                  "--precision", "bf16", "--runs_dir", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["plan"]
    assert plan["sharding_strategy"] == "FULL_SHARD" and plan["mixed_precision"]["param_dtype"] == "bf16"
