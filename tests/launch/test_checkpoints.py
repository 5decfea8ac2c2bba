"""Training checkpoints: exact resume in every backend, export, and starting one backend from another."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PARITY_ARGS, REPO, base_env, in_process, train
from gptlite.model import build_model, preset

# Tiers per test: the single runs are one-process launches, the rest multi-rank.

STEPS = 9
# --save_every 5: the checkpoint holds the state after step 4; a resume starts at 5, Adam's step 6,
# where float32 beta2^t by repeated products and by pow differ (DeepSpeed's C++ Adam keeps the
# former, outside its state_dict: backends/deepspeed_support.replay_adam_step_count).
SAVE_AFTER = 4
ARGS = (*PARITY_ARGS, "--steps", str(STEPS))
SAVE = ("--save_every", "5")
RESUME_DROPOUT = "0.1"  # dropout on, so a resume must restore each rank's RNG to match
BACKENDS = {  # name -> (flags, launcher)
    "single": (("--micro_batch", "4"), "python"),
    "ddp": (("--backend", "ddp", "--micro_batch", "2"), "torchrun"),
    "fsdp": (("--fsdp_config", "fsdp_configs/full_shard.yaml", "--micro_batch", "2"), "torchrun"),
    "fsdp2": (("--fsdp_config", "fsdp_configs/fsdp2.yaml", "--micro_batch", "2"), "torchrun"),
    "z1": (("--deepspeed_config", "ds_configs/z1.json", "--micro_batch", "2"), "deepspeed"),
    "z2": (("--deepspeed_config", "ds_configs/z2.json", "--micro_batch", "2"), "deepspeed"),
    "z3": (("--deepspeed_config", "ds_configs/z3.json", "--micro_batch", "2"), "torchrun"),
}
TIMEOUT = 900


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """For each backend: an uninterrupted run saving a checkpoint after step 2, then a second run
    resumed from that checkpoint (into the same record), with the first run's losses kept aside."""
    root = tmp_path_factory.mktemp("ckpt")
    done = {}

    def get(name, dropout=RESUME_DROPOUT):
        key = (name, dropout)
        if isinstance(done.get(key), BaseException):  # failed once: every test using it fails with that
            raise done[key]
        if key not in done:
            try:
                done[key] = _make(name, dropout)
            except BaseException as e:
                done[key] = e
                raise
        return done[key]

    def _make(name, dropout):
        flags, launcher = BACKENDS[name]
        flags = (*flags, "--dropout", dropout)
        run_name = f"{name}-dropout{dropout}"
        save_dir = root / "save" / run_name
        first = train(root / "runs", run_name, *ARGS, *SAVE, *flags, "--save_dir", str(save_dir), launcher=launcher,
                      timeout=TIMEOUT).check_ok()
        uninterrupted = first.metrics
        kept = root / f"{run_name}-checkpoint"
        shutil.copytree(save_dir, kept)  # the checkpoint after step 4, before anything else is saved
        assert (save_dir / "latest").read_text().strip() == "step_00000004"
        # Resume from it, as a restarted run would: same record, --resume.
        resumed = None if dropout != RESUME_DROPOUT else train(  # the resume tests use dropout
            root / "runs", run_name, *ARGS, *SAVE, *flags, "--save_dir", str(save_dir), "--resume", launcher=launcher,
            timeout=TIMEOUT).check_ok()
        return uninterrupted, resumed, kept

    return get


def _tier(name):
    return pytest.mark.launch if BACKENDS[name][1] == "python" else pytest.mark.distributed


@pytest.mark.parametrize("name", [pytest.param(n, marks=_tier(n)) for n in BACKENDS])
def test_resumed_run_continues_exactly(runs, name):
    uninterrupted, resumed, _ = runs(name)
    assert resumed.config["start_step"] == SAVE_AFTER + 1 and resumed.config["resumed_from"].endswith("step_00000004")
    assert [m["step"] for m in resumed.metrics] == list(range(STEPS))  # earlier lines kept, later replaced
    # On CPU in fp32 the resumed steps repeat the uninterrupted ones bit for bit.
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in uninterrupted]


def _export(checkpoint, out, as_process=False):
    """training.export of a checkpoint: as a process (the CLI), or its main in this process."""
    if as_process:
        proc = subprocess.run([sys.executable, "-m", "training.export", str(checkpoint), "--out", str(out)], cwd=REPO,
                              env=base_env(), capture_output=True, text=True, timeout=300)
    else:
        from training import export

        proc = in_process(export.main, [checkpoint, "--out", out])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(Path(out) / "model.pt")  # --out DIR: the file written there, last
    return torch.load(Path(out) / "model.pt")


@pytest.mark.parametrize("name", [pytest.param(n, marks=_tier(n)) for n in ("single", "fsdp", "z2", "z3")])
def test_export_gives_the_plain_models_state_dict(runs, name, tmp_path):
    exported = _export(runs(name)[2], tmp_path / "exported", as_process=name == "z3")  # one as the CLI
    reference = build_model(preset("tiny", vocab_size=65, dropout=0.0), 0).state_dict()
    assert exported["step"] == SAVE_AFTER
    assert set(exported["model"]) == set(reference)
    for key, value in exported["model"].items():
        assert value.shape == reference[key].shape and value.dtype == torch.float32 and torch.isfinite(value).all()


@pytest.mark.parametrize("name", [pytest.param(n, marks=_tier(n)) for n in ("single", "z3")])
def test_no_tool_writes_into_a_checkpoint_directory_a_run_wrote(runs, name, tmp_path):
    """core/owned.py knows the layout training/checkpoint.py writes (tests/unit/test_owned.py: every tool)."""
    from core.owned import is_checkpoint_dir
    from simulation import fake_world

    kept = runs(name)[2]
    assert is_checkpoint_dir(kept) and all(is_checkpoint_dir(step) for step in kept.glob("step_*"))
    before = {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    for out in (kept / "latest", kept / "step_00000004" / "meta.json", kept / "owner.json"):
        for proc in (in_process(fake_world.main, ["--world", "2", "--out", out, "--", "--preset", "tiny"]),
                     _export_call(kept, out)):
            assert proc.returncode == 2 and str(out) in proc.stderr and "checkpoint directory" in proc.stderr, proc.stderr
    assert {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()} == before


def _export_call(checkpoint, out):
    from training import export

    return in_process(export.main, [checkpoint, "--out", out])


@pytest.mark.distributed
@pytest.mark.parametrize("source, target", [("z3", "fsdp"), ("fsdp", "z3")])
def test_one_backend_continues_from_anothers_export(runs, source, target, tmp_path):
    # Without dropout: a run started from exported weights begins a fresh RNG stream, so only
    # then does its next step see the same computation as the source's.
    uninterrupted, _, checkpoint = runs(source, dropout="0")
    _export(checkpoint, tmp_path / source)
    export = tmp_path / source / "model.pt"
    flags, launcher = BACKENDS[target]
    run = train(tmp_path / "runs", f"{target}-from-{source}", *ARGS, *flags, "--dropout", "0", "--init_from",
                str(export), launcher=launcher, timeout=TIMEOUT).check_ok()
    assert run.config["start_step"] == SAVE_AFTER + 1
    # The next step's loss depends on the weights and the batch alone: the same as in the source.
    next_loss = run.metrics[0]["loss"]
    expected = uninterrupted[SAVE_AFTER + 1]["loss"]
    assert abs(next_loss - expected) / expected <= 1e-5, (next_loss, expected)


@pytest.mark.launch
def test_a_killed_save_leaves_the_previous_checkpoint_latest(runs, tmp_path):
    _, _, checkpoint = runs("single")
    save_dir = tmp_path / "save"
    shutil.copytree(checkpoint, save_dir)
    (save_dir / ".step_00000009.partial" / "model").mkdir(parents=True)  # as a run killed mid-save leaves it
    from training import checkpoint as ckpt

    directory, meta = ckpt.latest(save_dir)
    assert directory.name == "step_00000004" and meta["step"] == SAVE_AFTER and meta["format"] == "torch"
    assert json.loads((directory / "meta.json").read_text())["backend"] == "single"


# ------------------------------------------------------------------ a resume never loses a record
def _finished(runs, tmp_path):
    """A copy of the single run's finished record and its checkpoint, to try resumes against."""
    _, resumed, checkpoint = runs("single")
    record = tmp_path / "runs" / "r"
    shutil.copytree(resumed.dir, record)
    save_dir = tmp_path / "save"
    shutil.copytree(checkpoint, save_dir)
    return record, save_dir


def _resume(tmp_path, save_dir, *flags, steps=STEPS, name="r", as_process=False):
    """A resume of the single run that train.py refuses before training: its main in this process, or
    (as_process) train.py itself, for the exit code and the one line of the process."""
    argv = [*ARGS[:-1], str(steps), *BACKENDS["single"][0], "--dropout", RESUME_DROPOUT, "--runs_dir",
            str(tmp_path / "runs"), "--run_name", name, "--save_dir", str(save_dir), "--resume", "--quiet", *flags]
    if as_process:
        return subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=REPO, env=base_env(),
                              capture_output=True, text=True, timeout=300)
    import train
    from training.cli import build_parser, parse_args
    from training.run import main

    parser = build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES)
    return in_process(lambda a: main(parse_args(a, parser=parser)), argv)


def _snapshot(record):
    return {p.name: p.read_bytes() for p in record.iterdir() if p.is_file()}


@pytest.mark.launch
@pytest.mark.parametrize("damage", ["misspelled save_dir", "latest deleted", "latest names a missing checkpoint"])
def test_a_resume_without_a_usable_checkpoint_refuses_and_keeps_the_record(runs, tmp_path, damage):
    record, save_dir = _finished(runs, tmp_path)
    before = _snapshot(record)
    if damage == "misspelled save_dir":
        save_dir = tmp_path / "sav"
    elif damage == "latest deleted":
        (save_dir / "latest").unlink()
    else:
        (save_dir / "latest").write_text("step_00000007\n")
    proc = _resume(tmp_path, save_dir, steps=STEPS + 3, as_process=damage == "latest deleted")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "resume:" in proc.stderr
    assert _snapshot(record) == before


@pytest.mark.launch
@pytest.mark.parametrize("flags, steps, message", [
    ((), SAVE_AFTER + 1, "nothing left to train (its record is finished)"),
    (("--preset", "small"), STEPS, "is of another model"),
    (("--backend", "ddp"), STEPS, "has backend 'single', this run 'ddp'"),
])
def test_a_resume_that_cannot_continue_refuses_up_front(runs, tmp_path, flags, steps, message):
    record, save_dir = _finished(runs, tmp_path)
    before = _snapshot(record)
    proc = _resume(tmp_path, save_dir, *flags, steps=steps)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert _snapshot(record) == before


@pytest.mark.launch
@pytest.mark.parametrize("damage", ["state.pt truncated", "meta.json corrupt", "rng file truncated"])
def test_a_damaged_checkpoint_is_refused_before_training(runs, tmp_path, damage):
    record, save_dir = _finished(runs, tmp_path)
    step = save_dir / "step_00000004"
    target = {"state.pt truncated": step / "model" / "state.pt", "meta.json corrupt": step / "meta.json",
              "rng file truncated": step / "rng" / "rank0.pt"}[damage]
    target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])
    before = _snapshot(record)
    proc = _resume(tmp_path, save_dir, steps=STEPS + 3)
    assert proc.returncode == 2 and ("damaged" in proc.stderr or "no readable meta.json" in proc.stderr), proc.stderr
    assert _snapshot(record) == before


@pytest.mark.launch
def test_a_record_has_one_writer_at_a_time(tmp_path):
    import time

    long_run = subprocess.Popen([sys.executable, str(REPO / "train.py"), *PARITY_ARGS, "--steps", "100000",
                                 "--runs_dir", str(tmp_path / "runs"), "--run_name", "busy", "--quiet"], cwd=REPO,
                                env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "runs" / "busy" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not metrics.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        import train as train_py
        from training.cli import build_parser, parse_args
        from training.run import main

        parser = build_parser(description=train_py.DESCRIPTION, examples=train_py.EXAMPLES)
        second = in_process(lambda a: main(parse_args(a, parser=parser)), [  # refused before anything: in this process
            *PARITY_ARGS, "--steps", "3", "--runs_dir", tmp_path / "runs", "--run_name", "busy", "--overwrite", "--quiet"])
        assert second.returncode == 2 and "is being written by pid" in second.stderr, second.stderr
        assert json.loads((tmp_path / "runs" / "busy" / "summary.json").read_text())["status"] == "running"
    finally:
        long_run.kill()
        long_run.wait()
