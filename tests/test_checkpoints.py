"""Training checkpoints: exact resume in every backend, export, and starting one backend from another."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import PARITY_ARGS, REPO, base_env, train
from gptlite.model import build_model, preset

pytestmark = pytest.mark.distributed

STEPS = 5
SAVE_AFTER = 2  # --save_every 3: the checkpoint holds the state after step 2; a resume starts at 3
ARGS = (*PARITY_ARGS, "--steps", str(STEPS))
SAVE = ("--save_every", "3")
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
        if key not in done:
            flags, launcher = BACKENDS[name]
            flags = (*flags, "--dropout", dropout)
            run_name = f"{name}-dropout{dropout}"
            save_dir = root / "save" / run_name
            first = train(root / "runs", run_name, *ARGS, *SAVE, *flags, "--save_dir", str(save_dir), launcher=launcher,
                          timeout=TIMEOUT).check_ok()
            uninterrupted = first.metrics
            kept = root / f"{run_name}-checkpoint"
            shutil.copytree(save_dir, kept)  # the checkpoint after step 2, before anything else is saved
            assert (save_dir / "latest").read_text().strip() == "step_00000002"
            # Resume from it, as a restarted run would: same record, --resume.
            resumed = None if dropout != RESUME_DROPOUT else train(  # the resume tests use dropout
                root / "runs", run_name, *ARGS, *SAVE, *flags, "--save_dir", str(save_dir), "--resume", launcher=launcher,
                timeout=TIMEOUT).check_ok()
            done[key] = (uninterrupted, resumed, kept)
        return done[key]

    return get


@pytest.mark.parametrize("name", list(BACKENDS))
def test_resumed_run_continues_exactly(runs, name):
    uninterrupted, resumed, _ = runs(name)
    assert resumed.config["start_step"] == SAVE_AFTER + 1 and resumed.config["resumed_from"].endswith("step_00000002")
    assert [m["step"] for m in resumed.metrics] == list(range(STEPS))  # earlier lines kept, later replaced
    # On CPU in fp32 the resumed steps repeat the uninterrupted ones bit for bit.
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in uninterrupted]


def _export(checkpoint, out):
    proc = subprocess.run([sys.executable, "-m", "training.export", str(checkpoint), "--out", str(out)], cwd=REPO,
                          env=base_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return torch.load(out)


@pytest.mark.parametrize("name", ["single", "fsdp", "z2", "z3"])
def test_export_gives_the_plain_models_state_dict(runs, name, tmp_path):
    exported = _export(runs(name)[2], tmp_path / "model.pt")
    reference = build_model(preset("tiny", vocab_size=65, dropout=0.0), 0).state_dict()
    assert exported["step"] == SAVE_AFTER
    assert set(exported["model"]) == set(reference)
    for key, value in exported["model"].items():
        assert value.shape == reference[key].shape and value.dtype == torch.float32 and torch.isfinite(value).all()


@pytest.mark.parametrize("source, target", [("z3", "fsdp"), ("fsdp", "z3")])
def test_one_backend_continues_from_anothers_export(runs, source, target, tmp_path):
    # Without dropout: a run started from exported weights begins a fresh RNG stream, so only
    # then does its next step see the same computation as the source's.
    uninterrupted, _, checkpoint = runs(source, dropout="0")
    export = tmp_path / f"{source}.pt"
    _export(checkpoint, export)
    flags, launcher = BACKENDS[target]
    run = train(tmp_path / "runs", f"{target}-from-{source}", *ARGS, *flags, "--dropout", "0", "--init_from",
                str(export), launcher=launcher, timeout=TIMEOUT).check_ok()
    assert run.config["start_step"] == SAVE_AFTER + 1
    # The next step's loss depends on the weights and the batch alone: the same as in the source.
    next_loss = run.metrics[0]["loss"]
    expected = uninterrupted[SAVE_AFTER + 1]["loss"]
    assert abs(next_loss - expected) / expected <= 1e-5, (next_loss, expected)


def test_a_killed_save_leaves_the_previous_checkpoint_latest(runs, tmp_path):
    _, _, checkpoint = runs("single")
    save_dir = tmp_path / "save"
    shutil.copytree(checkpoint, save_dir)
    (save_dir / ".step_00000005.partial" / "model").mkdir(parents=True)  # as a run killed mid-save leaves it
    from training import checkpoint as ckpt

    directory, meta = ckpt.latest(save_dir)
    assert directory.name == "step_00000002" and meta["step"] == SAVE_AFTER and meta["format"] == "torch"
    assert json.loads((directory / "meta.json").read_text())["backend"] == "single"
