"""The tools around runs keep their promises on damaged or wrong input (no launches: fast).

analysis.report / analysis.table read past a damaged record; report, export and estimate refuse
bad arguments with one line and exit code 2; a run's failure is worded so that it can be acted on
(Ctrl-C, a failed CPU allocation is out of memory); --help shows only the suite's own flags.
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TRAIN, base_env
from core.dist import DistEnv
from core.records import atomic_write_json
from core.summary import RunSummary
from gptlite.errors import ConfigError
from training.run import describe_error, is_oom

REFERENCE = REPO / "runs" / "reference" / "nvidia-h100-80gb-hbm3" / "gpu_reference"


def _tool(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def records_with_a_damaged_one(tmp_path):
    runs = tmp_path / "runs"
    for name in ("single-w1-paper-mb8-bf16-ckpt0", "ddp-w1-paper-mb8-bf16-ckpt0"):
        shutil.copytree(REFERENCE / name, runs / name)
    (runs / "broken").mkdir()
    (runs / "broken" / "summary.json").write_text('{"status": "ok", "run_na')  # cut off mid-write
    return runs


@pytest.mark.parametrize("module", ["analysis.table", "analysis.report"])
def test_a_damaged_record_is_skipped_and_named(records_with_a_damaged_one, tmp_path, module):
    args = ["--out", str(tmp_path / "report")] if module == "analysis.report" else []
    proc = _tool("-m", module, str(records_with_a_damaged_one), *args)
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {records_with_a_damaged_one / 'broken'}" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["-m", "analysis.report", str(REFERENCE), "--out", "{FILE}"], "--out {FILE} exists and is not a directory"),
    (["-m", "training.export", str(REFERENCE), "--out", "{DIR}"], "--out {DIR} is a directory"),
    (["-m", "analysis.estimate", "--world", "0"], "world must be an integer >= 1 (got 0)"),
    (["-m", "analysis.estimate", "--micro_batch", "-4"], "micro_batch must be an integer >= 1 (got -4)"),
    (["-m", "analysis.estimate", "--ckpt_interval", "-1"], "ckpt_interval must be an integer >= 0 (got -1)"),
    (["-m", "analysis.estimate", "--config", "ds_configs/z3.json", "--fsdp_config", "fsdp_configs/fsdp2.yaml"],
     "exclude each other"),
    (["-m", "analysis.estimate", "--fsdp_config", "fsdp_configs/hybrid_shard.yaml", "--world", "3",
      "--ranks_per_node", "2"],
     "hybrid_shard_size 2 must be >= 2 and divide the world size 3"),
])
def test_tools_refuse_bad_arguments_in_one_line(tmp_path, args, message):
    file, directory = tmp_path / "taken.md", tmp_path / "a_dir"
    file.write_text("x")
    directory.mkdir()
    args = [a.replace("{FILE}", str(file)).replace("{DIR}", str(directory)) for a in args]
    message = message.replace("{FILE}", str(file)).replace("{DIR}", str(directory))
    proc = _tool(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "taken.md"]  # nothing left behind
    assert not list(directory.iterdir())


def test_failures_are_worded_to_be_acted_on():
    assert describe_error(KeyboardInterrupt()) == "KeyboardInterrupt: interrupted (Ctrl-C, or SIGINT from the launcher)"
    with pytest.raises(RuntimeError) as failed:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB, more than any machine has: the CPU allocator's own failure
    assert is_oom(failed.value), failed.value
    assert not is_oom(RuntimeError("shapes do not match"))


def test_help_shows_the_suites_flags_only():
    proc = _tool(str(TRAIN), "--help")
    assert proc.returncode == 0
    assert "--deepspeed_config" in proc.stdout and "--activation_checkpoint_interval" in proc.stdout
    assert "--deepscale" not in proc.stdout


def test_a_summary_is_complete_whatever_the_status(tmp_path):
    atomic_write_json(tmp_path / "summary.json", RunSummary("r", backend="ddp", world_size=2).ended(
        "failed", "rank 1: RuntimeError: boom", 3.0).to_dict())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["samples_per_s"] is None and summary["schema_version"] == 1
    with pytest.raises(ValueError, match="status must be one of"):
        RunSummary("r", status="finished")


def test_a_model_larger_than_the_machine_is_refused_before_anything_is_built_or_recorded(tmp_path, monkeypatch):
    """Every rank builds the whole model before sharding it: parameters beyond the machine's memory
    are refused in one line naming --model_args, with no run directory, before any allocation."""
    from training import memory_check
    from training.cli import config_from_argv
    from training.run import resolve

    runs = tmp_path / "runs"
    huge = ["--model", "hf:gpt2", "--model_args", "n_layer=4,n_embd=16384,n_head=16", "--device", "cpu",
            "--runs_dir", str(runs), "--steps", "1"]
    size = memory_check.model_bytes(resolve(config_from_argv([*huge, "--dry_run"])).workload.meta())
    assert size > 50e9  # ~12.9 B fp32 parameters, measured on the meta device
    # The machine's memory as the kernel reports it, held just below the model.
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: size - 1)
    with pytest.raises(ConfigError, match=r"^model_args: the model's parameters .* 5\d\.\d GB.* available"):
        resolve(config_from_argv(huge))
    assert not runs.exists()
    # Two ranks on the machine build it twice: refused with room for one.
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: int(size * 1.5))
    meta = resolve(config_from_argv([*huge, "--dry_run"])).workload.meta()
    memory_check.check_model_fits(config_from_argv(huge), DistEnv(0, 0, 1, 1, torch.device("cpu"), "python"), meta)
    with pytest.raises(ConfigError, match="each of the 2 ranks on this machine"):
        memory_check.check_model_fits(config_from_argv(huge), DistEnv(0, 0, 2, 2, torch.device("cpu"), "torchrun"),
                                      meta)
    # The real machine's memory: the small models of the tests and demos are never refused.
    monkeypatch.undo()
    small = config_from_argv(["--preset", "small", "--device", "cpu", "--runs_dir", str(runs), "--steps", "1"])
    resolve(small)
