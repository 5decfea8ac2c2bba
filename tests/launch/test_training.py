"""Training behaviour: the loss falls, DDP equals single, accumulation equals a larger micro-batch."""

import pytest

from conftest import PARITY_ARGS, assert_losses_close, matrix_run, train

STEPS = 10
RTOL = 1e-5

pytestmark = pytest.mark.launch  # one-process runs of train.py; the 2-rank ones say so


def test_loss_falls_on_the_embedded_corpus(runs_dir):
    run = train(runs_dir, "learn", "--preset", "tiny", "--steps", "40", "--micro_batch", "16",
                "--lr_warmup_steps", "5", "--mem_profile_steps", "0").check_ok()
    losses = run.losses
    assert losses[0] > 4.0  # about ln(65) at initialisation
    assert losses[-1] < losses[0] - 1.0, losses
    assert run.summary["val_loss"] < losses[0] - 1.0


def test_accumulation_equals_a_larger_micro_batch(runs_dir, launches, request):
    """Micro-batch 4 with 2-step accumulation, one process: the reference's micro-batch 8."""
    reference = launches.get("reference", request)
    accumulated = train(runs_dir, "m4x2", *PARITY_ARGS, "--steps", str(STEPS), "--micro_batch", "4", "--grad_accum",
                        "2").check_ok()
    assert accumulated.summary["global_batch"] == reference.summary["global_batch"] == 8
    assert_losses_close(accumulated.losses, reference.losses, STEPS, RTOL)


def test_ddp_runs_as_a_world_of_one_under_plain_python(runs_dir):
    run = train(runs_dir, "ddp-python", *PARITY_ARGS, "--backend", "ddp", "--steps", "2").check_ok()
    assert run.summary["world_size"] == 1 and run.config["launcher"] == "python"


def test_a_diverging_run_is_recorded_as_failed(runs_dir):
    run = train(runs_dir, "diverge", *PARITY_ARGS, "--steps", "20", "--lr", "1e30")
    assert run.proc.returncode == 1
    assert run.summary["status"] == "failed"
    assert "loss is" in run.summary["error"]


def test_a_run_whose_validation_loss_is_not_finite_is_recorded_as_failed(runs_dir):
    """One step at an absurd learning rate: the training loss (taken before the update) is finite,
    the validation loss after it is not; the run failed, whatever its training loss said."""
    run = train(runs_dir, "nan_val", *PARITY_ARGS, "--steps", "1", "--lr", "1e9", "--grad_clip", "0")
    assert run.proc.returncode == 1
    assert run.summary["status"] == "failed"
    assert "FloatingPointError: validation loss is nan after step 0" in run.summary["error"], run.summary
    assert "Traceback" not in run.proc.stderr  # an outcome of the settings, said in one line


def test_a_model_file_whose_validation_data_holds_nan_fails(runs_dir, tmp_path):
    """The training split is finite, the validation split is not: the run failed, with the reason."""
    model = tmp_path / "nan_val.py"
    model.write_text(
        "import torch, torch.nn as nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self): super().__init__(); self.l = nn.Linear(8, 8)\n"
        "    def forward(self, x): return torch.relu(self.l(x))\n"
        "class Net(nn.Module):\n"
        "    def __init__(self): super().__init__(); self.blocks = nn.ModuleList([Block(), Block()]); self.head = nn.Linear(8, 4)\n"
        "    def forward(self, x):\n"
        "        for b in self.blocks: x = b(x)\n"
        "        return self.head(x)\n"
        "def split(n, nan):\n"
        "    g = torch.Generator().manual_seed(n)\n"
        "    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)\n"
        "    if nan: x[:] = float('nan')\n"
        "    return torch.utils.data.TensorDataset(x, y)\n"
        "def get_model(): return Net()\n"
        "def get_dataset(): return split(64, False), split(16, True)\n")
    run = train(runs_dir, "nan_val_file", "--model", str(model), "--steps", "2", "--eval_batches", "1",
                "--mem_profile_steps", "0", "--warmup_steps", "0")
    assert run.proc.returncode == 1 and run.summary["status"] == "failed", run.proc.stderr
    assert "FloatingPointError: validation loss is nan" in run.summary["error"], run.summary


def test_a_failure_with_a_message_on_several_lines_is_recorded_on_one(runs_dir):
    """The injected error's message has two lines, as dynamo's and many libraries' do: the record keeps
    the first (the report's tables show it), the log the whole of it, with the traceback."""
    run = train(runs_dir, "two_lines", *PARITY_ARGS, "--steps", "3", env={"GPTLITE_FAULT": "kind=error,step=1"})
    assert run.proc.returncode == 1 and run.summary["status"] == "failed"
    error = run.summary["error"]
    assert "\n" not in error and error.endswith("RuntimeError: injected fault (GPTLITE_FAULT) at step 1 (more in the log)")
    assert "the rest of a message on several lines" in run.proc.stderr
