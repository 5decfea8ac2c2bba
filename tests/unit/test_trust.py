"""The tools around runs keep their promises on damaged or wrong input (no launches: fast).

analysis.report / analysis.tables read past a damaged record; report, export and estimate refuse
bad arguments with one line and exit code 2; a run's failure is worded so that it can be acted on
(Ctrl-C, a failed CPU allocation is out of memory); --help shows only the suite's own flags.
"""

import json
import subprocess
import sys

import pytest
import torch

from analysis import compact
from conftest import REPO, TRAIN, base_env
from core.dist import DistEnv
from core.records import atomic_write_json
from core.summary import RunSummary
from gptlite.errors import ConfigError
from training.lifecycle import describe_error, is_oom

REFERENCE = REPO / "runs" / "reference" / "nvidia-h100-80gb-hbm3"  # a compact folder (analysis/compact.py)


def _tool(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def records_with_a_damaged_one(tmp_path):
    runs = tmp_path / "runs"
    for name in ("single-w1-paper-mb8-bf16-ckpt0", "ddp-w1-paper-mb8-bf16-ckpt0"):  # real records, on disk
        compact.unpack(REFERENCE / "gpu_reference" / name, runs / name)
    (runs / "broken").mkdir()
    (runs / "broken" / "summary.json").write_text('{"status": "ok", "run_na')  # cut off mid-write
    return runs


@pytest.mark.launch
@pytest.mark.parametrize("module", ["analysis.tables", "analysis.report"])
def test_a_damaged_record_is_skipped_and_named(records_with_a_damaged_one, tmp_path, module):
    args = ["--out", str(tmp_path / "report")] if module == "analysis.report" else []
    proc = _tool("-m", module, str(records_with_a_damaged_one), *args)
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {records_with_a_damaged_one / 'broken'}" in proc.stderr and "Traceback" not in proc.stderr


def _in_process(args):
    """`python -m MODULE ARGS`'s main called in this process (the logic)."""
    import importlib

    from conftest import in_process

    return in_process(importlib.import_module(args[1]).main, args[2:])


TOOL_CASES = [
    (["-m", "analysis.report", str(REFERENCE), "--out", "{FILE}"], "--out: {FILE} exists and is not a directory"),
    (["-m", "training.export", str(REFERENCE), "--out", "{FILE}"], "--out {FILE}: --out names a directory (this tool "
                                                                    "writes model.pt in it)"),
    (["-m", "analysis.claims", str(REFERENCE), "--out", "{FILE}"], "--out: {FILE} exists and is not a directory"),
    (["-m", "analysis.claims", "{FILE}", "--out", "{DIR}"], "runs_dir {FILE} is not a directory"),
    (["-m", "analysis.estimate_cli", "--world", "0"], "world must be an integer >= 1 (got 0)"),
    (["-m", "analysis.estimate_cli", "--micro_batch", "-4"], "micro_batch must be >= 1 (got -4)"),
    (["-m", "analysis.estimate_cli", "--ckpt_interval", "-1"], "ckpt_interval must be >= 0 (got -1)"),
    (["-m", "analysis.estimate_cli", "--deepspeed_config", "ds_configs/z3.json", "--fsdp_config",
      "fsdp_configs/fsdp2.yaml"], "fsdp_config applies to backends fsdp and fsdp2 (got backend 'deepspeed')"),
    (["-m", "analysis.estimate_cli", "--fsdp_config", "fsdp_configs/hybrid_shard.yaml", "--world", "2",
      "--gpus_per_node", "1"], "hybrid_shard_size 1 must be >= 2"),
    (["-m", "analysis.estimate_cli", "--world", "3", "--gpus_per_node", "2"], "gpus_per_node 2 must divide world 3"),
]
AS_PROCESS = (0, 1, 2, 4)  # one refusal of each tool as a process (its exit code, its one line); the rest here


@pytest.mark.parametrize("args, message, as_process", [
    pytest.param(*case, i in AS_PROCESS, marks=[pytest.mark.launch] if i in AS_PROCESS else [])
    for i, case in enumerate(TOOL_CASES)])
def test_tools_refuse_bad_arguments_in_one_line(tmp_path, args, message, as_process):
    file, directory = tmp_path / "taken.md", tmp_path / "a_dir"
    file.write_text("x")
    directory.mkdir()
    args = [a.replace("{FILE}", str(file)).replace("{DIR}", str(directory)) for a in args]
    message = message.replace("{FILE}", str(file)).replace("{DIR}", str(directory))
    proc = _tool(*args) if as_process else _in_process(args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "taken.md"]  # nothing left behind
    assert not list(directory.iterdir())


def test_failures_are_worded_to_be_acted_on():
    interrupted = "KeyboardInterrupt: interrupted (Ctrl-C, or SIGINT from the launcher)"
    assert describe_error(KeyboardInterrupt()) == interrupted
    # A record's error is one line: the first of a message on several, and an interrupt that a library
    # wrapped (dynamo, when Ctrl-C lands in a compile) is the interrupt.
    assert describe_error(RuntimeError("first\n\n  second\nthird")) == "RuntimeError: first (more in the log)"
    assert describe_error(ValueError()) == "ValueError"
    # A library's exit() inside the step (DeepSpeed's autotuner after its profiled steps) was "SystemExit: None".
    exited = "SystemExit: code None: the run was ended by an exit() inside its step"
    assert describe_error(SystemExit()).startswith(exited)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise RuntimeError("backend compiler failed\nwith a long story") from e
    except RuntimeError as wrapped:
        assert describe_error(wrapped) == interrupted
    with pytest.raises(RuntimeError) as failed:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB, more than any machine has: the CPU allocator's own failure
    assert is_oom(failed.value), failed.value
    assert not is_oom(RuntimeError("shapes do not match"))


def test_a_budget_breach_is_raised_before_rank_0_counts_flops_and_a_stop_is_never_swallowed():
    # Seen in CI: rank 1 failed over --mem_budget_gb at once while rank 0 was still counting FLOPs;
    # the launcher's SIGTERM landed in the count, whose `except Exception` took the stop for a
    # counting error (torch's fake-tensor dispatch logged a traceback through our files) and went on.
    from training.loop import LoopResult
    from training.results import MemoryBudgetExceeded, finished_summary
    from training.lifecycle import Terminated

    counted = []
    ranks = [{"profiled": {"peak_bytes": 5 * 2**20}, "state": {}}] * 2
    with pytest.raises(MemoryBudgetExceeded):
        finished_summary(RunSummary("r"), LoopResult(profiled={"peak_bytes": 5 * 2**20}), ranks, None, 2,
                         0.001, 0.0, {}, lambda: counted.append(1))
    assert counted == []  # the budget was checked first
    assert not issubclass(Terminated, Exception)  # no `except Exception` on the way swallows a stop
    try:
        raise Terminated("stop")
    except Exception:  # noqa: BLE001
        pytest.fail("an `except Exception` caught the launcher's stop request")
    except BaseException:
        pass


@pytest.mark.launch
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


# ------------------------------------------------------------------ a checkpoint directory belongs to one run
# In-process runs through test_loop's fake backend (no launches: fast).
def _ckpt_files(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != "owner.lock"}


def test_a_second_run_into_a_checkpoint_directory_is_refused_and_deletes_nothing(tmp_path):
    from gptlite.errors import ConfigError
    from test_loop import make_setup
    from training.lifecycle import EXIT_OK, Run

    save = {"save_dir": str(tmp_path / "ckpt"), "save_every": 1, "keep_checkpoints": 2}
    assert Run(make_setup(tmp_path, run_name="first", steps=3, **save)).execute() == EXIT_OK
    before = _ckpt_files(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000001", "step_00000002"]
    # Another run, however it asks (--overwrite, --resume), and this record started over.
    for name, flags, whose in [("second", {"overwrite": False}, "the run"), ("second", {"overwrite": True}, "the run"),
                               ("second", {"resume": True}, "the run"), ("first", {"overwrite": True}, "an earlier run")]:
        with pytest.raises(ConfigError, match=f"save_dir: .* holds the checkpoints of {whose}"):
            make_setup(tmp_path, run_name=name, steps=5, **{**save, **flags})
        assert _ckpt_files(tmp_path / "ckpt") == before
    assert not (tmp_path / "runs" / "second").exists()
    # The run itself resumed owns it: its rotation deletes its own older checkpoints.
    assert Run(make_setup(tmp_path, run_name="first", steps=5, resume=True, **save)).execute() == EXIT_OK
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000003", "step_00000004"]


def test_a_checkpoint_directory_has_one_writer_at_a_time(tmp_path):
    from gptlite.errors import ConfigError
    from test_loop import make_setup
    from training.locks import FileLock

    held = FileLock(tmp_path / "ckpt" / "owner.lock")  # as another run writing into it holds it
    try:
        with pytest.raises(ConfigError, match=r"save_dir: .* is being written by pid \d+"):
            make_setup(tmp_path, save_dir=str(tmp_path / "ckpt"), save_every=1)
    finally:
        held.release()


class _Saving:
    """What checkpoint.save needs of a backend."""
    checkpoint_format = "torch"

    def save_checkpoint(self, directory):
        directory.mkdir(parents=True)
        (directory / "state").write_text("x")


def test_rotation_deletes_only_this_runs_checkpoints(tmp_path):
    """Checkpoints of another run in the directory (written before directories had owners) are
    neither rotated away nor counted, and the checkpoint `latest` names is never deleted."""
    from training import checkpoint

    save_dir = tmp_path / "ckpt"

    def save(step, run):
        checkpoint.save(_Saving(), save_dir, step, 0, {"run_id": run, "record": str(tmp_path / run),
                                                       "run_name": run}, keep=2)

    save(4, "theirs")
    save(9, "theirs")
    save(2, "ours")
    assert (save_dir / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in save_dir.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000009"]
    save(3, "ours")
    save(5, "ours")
    assert sorted(p.name for p in save_dir.glob("step_*")) == ["step_00000003", "step_00000004", "step_00000005",
                                                              "step_00000009"]
    assert (save_dir / "latest").read_text().strip() == "step_00000005"


@pytest.mark.parametrize("key", ["save_dir", "resume"])
def test_a_sweep_does_not_share_a_checkpoint_directory_between_its_runs(key):
    from gptlite.errors import ConfigError
    from orchestration.sweep import Matrix, SweepSpec, expand

    with pytest.raises(ConfigError, match=f"train_args: '{key}' is set by the sweep: with save_every each run "
                                          "checkpoints into <runs dir>/.ckpt/<run>"):
        SweepSpec(name="t", matrix=Matrix(backend=["ddp", "fsdp"]), train_args={key: "ckpt" if key == "save_dir" else True})
    # With save_every, each run has a directory of its own.
    runs = expand(SweepSpec(name="t", matrix=Matrix(backend=["ddp", "fsdp"]), train_args={"save_every": 2}))[0]
    dirs = [dict(r.flags)["save_dir"] for r in runs]
    assert len(dirs) == len(set(dirs)) == 2


def test_train_py_takes_no_abbreviated_flags():
    from gptlite.errors import ConfigError
    from training.cli import config_from_argv

    assert config_from_argv(["--save_dir", "x", "--save_every", "1"]).save_every == 1
    with pytest.raises(ConfigError, match="unrecognized arguments: --save_d x --save_ev 1"):
        config_from_argv(["--save_d", "x", "--save_ev", "1"])


# ------------------------------------------------------------------ a resume is checked before anything starts
MODEL_FILE = '''
import torch
import torch.nn as nn

WIDTH = {width}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.linear(x)


def get_model():
    return nn.Sequential(nn.Linear(4, WIDTH), Block(), Block(), nn.Linear(WIDTH, 3))


def get_dataset():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, generator=g), i % 3) for i in range(40)]
'''


def _model_file_setup(tmp_path, **flags):
    """A run of a model file through test_loop's fake backend, resolved in-process."""
    import torch

    from backends.base import Resolved
    from core.config import RunConfig
    from core.dist import DistEnv
    from test_loop import FakeBackend
    from training.run import prepare_run

    cfg = RunConfig(**{"model": str(tmp_path / "net.py"), "micro_batch": 2, "grad_accum": 1, "steps": 3, "warmup_steps": 0,
                       "mem_profile_steps": 0, "eval_batches": 1, "quiet": True, "runs_dir": str(tmp_path / "runs"),
                       "run_name": "net", "lr": 0.05, "lr_warmup_steps": 0, "grad_clip": 0.0, "precision": "fp32",
                       "save_dir": str(tmp_path / "ckpt"), "save_every": 1, **flags})
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  launcher="python")
    return prepare_run(cfg, env, Resolved(FakeBackend, cfg))


def _files(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_resume_after_the_model_file_changed_is_refused_up_front(tmp_path):
    from gptlite.errors import ConfigError
    from training.lifecycle import EXIT_OK, Run

    (tmp_path / "net.py").write_text(MODEL_FILE.format(width=8))
    assert Run(_model_file_setup(tmp_path)).execute() == EXIT_OK
    record = _files(tmp_path / "runs" / "net")
    (tmp_path / "net.py").write_text(MODEL_FILE.format(width=16))  # same name and args, other shapes
    with pytest.raises(ConfigError, match=r"resume: the checkpoint .*step_00000002 holds other parameters than this "
                                          r"run's model \(first difference: net.0.bias: \[8\] there, \[16\] here\)"):
        _model_file_setup(tmp_path, steps=5, resume=True)
    assert _files(tmp_path / "runs" / "net") == record


def test_a_resume_without_a_checkpoint_replaces_a_record_only_with_the_same_run(tmp_path):
    """An unfinished record with no checkpoint is started over by --resume (torchrun's restarts)
    only for the same settings; --steps may grow, as a resume's may."""
    from gptlite.errors import ConfigError
    from test_loop import make_setup
    from training.lifecycle import EXIT_FAILED, EXIT_OK, Run

    save = {"save_dir": str(tmp_path / "ckpt"), "save_every": 100}
    assert Run(make_setup(tmp_path, fail=("step", 1), **save)).execute() == EXIT_FAILED  # before any checkpoint
    record = _files(tmp_path / "runs" / "fake")
    for flags, difference in [({"preset": "small"}, "--preset 'tiny' there, 'small' here"),
                              ({"lr": 0.01}, "--lr 0.05 there, 0.01 here"),
                              ({"micro_batch": 4}, "--micro_batch 2 there, 4 here"),
                              ({"model": "hf:gpt2", "model_args": "n_layer=1,n_embd=16,n_head=2"}, "--model 'gptlite' there, 'hf:gpt2' here")]:
        with pytest.raises(ConfigError, match=f"resume: .* was recorded with other settings \\({difference}\\)"):
            make_setup(tmp_path, resume=True, **{**save, **flags})
        assert _files(tmp_path / "runs" / "fake") == record
    restarted = make_setup(tmp_path, resume=True, steps=5, **save)
    assert restarted.resume is None and Run(restarted).execute() == EXIT_OK


def test_checkpoints_are_not_kept_inside_a_record(tmp_path):
    """A record is replaced as a whole (--overwrite, a sweep's retry): checkpoints inside one would go with it."""
    from gptlite.errors import ConfigError
    from test_loop import make_setup
    from training.lifecycle import EXIT_OK, Run

    with pytest.raises(ConfigError, match=r"save_dir: .*runs/fake/ckpt is inside the run record .*runs/fake, which"):
        make_setup(tmp_path, save_dir=str(tmp_path / "runs" / "fake" / "ckpt"), save_every=1)
    assert Run(make_setup(tmp_path, run_name="other")).execute() == EXIT_OK
    with pytest.raises(ConfigError, match=r"save_dir: .*runs/other/ckpt is inside the run record .*runs/other, which"):
        make_setup(tmp_path, save_dir=str(tmp_path / "runs" / "other" / "ckpt"), save_every=1)
    # A record still running has no summary yet: its config.json says what it is.
    (tmp_path / "runs" / "other" / "summary.json").unlink()
    with pytest.raises(ConfigError, match=r"save_dir: .*runs/other/ckpt is inside the run record .*runs/other, which"):
        make_setup(tmp_path, save_dir=str(tmp_path / "runs" / "other" / "ckpt"), save_every=1)


@pytest.mark.parametrize("target", ["step_00000004/model/state.pt", "latest"])
def test_an_export_is_never_written_into_a_checkpoint(tmp_path, target, capsys):
    from training import export

    step = tmp_path / "ckpt" / "step_00000004"
    (step / "model").mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 4, "format": "torch"}')
    (step / "model" / "state.pt").write_bytes(b"the run's state")
    (tmp_path / "ckpt" / "latest").write_text("step_00000004\n")
    before = _files(tmp_path / "ckpt")
    assert export.main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "ckpt" / target)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is in the checkpoint directory" in err, err
    assert _files(tmp_path / "ckpt") == before


def test_a_resume_continues_a_record_only_with_its_settings(tmp_path):
    """A resumed run continues its record: one record holds one run's settings (--steps may grow)."""
    from gptlite.errors import ConfigError
    from test_loop import make_setup
    from training.lifecycle import EXIT_OK, Run

    save = {"save_dir": str(tmp_path / "ckpt"), "save_every": 1}
    assert Run(make_setup(tmp_path, **save)).execute() == EXIT_OK
    record = _files(tmp_path / "runs" / "fake")
    for flags, difference in [({"lr": 0.01}, "--lr 0.05 there, 0.01 here"), ({"seed": 1}, "--seed 1337 there, 1 here"),
                              ({"eval_batches": 2}, "--eval_batches 1 there, 2 here")]:
        with pytest.raises(ConfigError, match=f"resume: the checkpoint .* continues .*fake, recorded with other "
                                              f"settings \\({difference}\\)"):
            make_setup(tmp_path, resume=True, steps=5, **{**save, **flags})
        assert _files(tmp_path / "runs" / "fake") == record
    assert make_setup(tmp_path, resume=True, steps=5, **save).resume is not None


def test_an_nvme_swap_directory_has_one_run_at_a_time(tmp_path):
    """DeepSpeed clears each rank's swap folder under nvme_path as it starts: a second run into the
    same directory would pull a live run's parameters from under it."""
    import torch

    from backends.base import Resolved
    from core.dist import DistEnv
    from gptlite.errors import ConfigError
    from backends.deepspeed import DeepSpeedBackend
    from test_loop import FakeBackend, make_setup
    from training.locks import FileLock
    from training.run import prepare_run

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    plan = type("Plan", (), {"config": {"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)}}}})()
    # A backend that swaps where DeepSpeed's spec says (DeepSpeedBackend.swap_dirs).
    Swapping = type("Swapping", (FakeBackend,), {"swap_dirs": classmethod(DeepSpeedBackend.swap_dirs.__func__)})
    cfg = make_setup(tmp_path).cfg
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), launcher="python")
    held = FileLock(nvme / "gptlite.lock")  # as a live run using it holds it
    try:
        with pytest.raises(ConfigError, match=r"nvme_path: .*nvme is being used by pid \d+"):
            prepare_run(cfg, env, Resolved(Swapping, cfg, plan))
    finally:
        held.release()
    assert prepare_run(cfg, env, Resolved(Swapping, cfg, plan)).nvme_locks


def test_replacing_a_record_never_deletes_checkpoints_inside_it(tmp_path):
    from gptlite.errors import ConfigError
    from test_loop import make_setup
    from training.lifecycle import EXIT_OK, Run

    assert Run(make_setup(tmp_path)).execute() == EXIT_OK
    step = tmp_path / "runs" / "fake" / "ckpt" / "step_00000004"  # a --save_dir inside it, from before that was refused
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 4}')
    with pytest.raises(ConfigError, match=r"run_name: .*fake holds checkpoints \(.*step_00000004\), which replacing"):
        make_setup(tmp_path, overwrite=True)
    assert (step / "meta.json").exists()


def test_a_model_larger_than_the_machine_is_refused_before_anything_is_built_or_recorded(tmp_path, monkeypatch):
    """Every rank builds the whole model before sharding it: parameters beyond the machine's memory
    are refused in one line naming --model_args, with no run directory, before any allocation."""
    from training import memory_check
    from training.cli import config_from_argv
    from training.run import prepare_run

    runs = tmp_path / "runs"
    huge = ["--model", "hf:gpt2", "--model_args", "n_layer=4,n_embd=16384,n_head=16", "--device", "cpu",
            "--runs_dir", str(runs), "--steps", "1"]
    size = memory_check.model_bytes(prepare_run(config_from_argv([*huge, "--dry_run"])).workload.meta())
    assert size > 50e9  # ~12.9 B fp32 parameters, measured on the meta device
    # The machine's memory as the kernel reports it, held just below the model.
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: size - 1)
    with pytest.raises(ConfigError, match=r"^model_args: the model's parameters .* 5\d\.\d GB.* available"):
        prepare_run(config_from_argv(huge))
    assert not runs.exists()
    # Two ranks on the machine build it twice: refused with room for one.
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: int(size * 1.5))
    meta = prepare_run(config_from_argv([*huge, "--dry_run"])).workload.meta()
    memory_check.check_model_fits(config_from_argv(huge), DistEnv(0, 0, 1, 1, torch.device("cpu"), "python"), meta)
    with pytest.raises(ConfigError, match="each of the 2 ranks on this machine"):
        memory_check.check_model_fits(config_from_argv(huge), DistEnv(0, 0, 2, 2, torch.device("cpu"), "torchrun"),
                                      meta)
    # The real machine's memory: the small models of the tests and demos are never refused.
    # GPT-lite's size comes from its flags: the line names the ones given, or the preset.
    for flags, named in [(["--n_layer", "48", "--n_embd", "4096", "--n_head", "8"], "n_layer/n_embd"), (["--preset", "paper"], "preset")]:
        argv = [*flags, "--device", "cpu", "--runs_dir", str(runs), "--steps", "1"]
        size = memory_check.model_bytes(prepare_run(config_from_argv([*argv, "--dry_run"])).workload.meta())
        monkeypatch.setattr(memory_check, "available_host_bytes", lambda: size - 1)
        with pytest.raises(ConfigError, match=rf"^{named}: the model's parameters"):
            prepare_run(config_from_argv(argv))
        assert not runs.exists()
    monkeypatch.undo()
    small = config_from_argv(["--preset", "small", "--device", "cpu", "--runs_dir", str(runs), "--steps", "1"])
    prepare_run(small)
