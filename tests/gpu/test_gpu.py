"""On a CUDA device (the gpu tier: skipped, saying so, on a machine without one)."""

import pytest

from conftest import train

pytestmark = pytest.mark.gpu


def test_a_run_on_the_gpu_trains_and_records_its_device(tmp_path):
    """train.py on the GPU in bf16, as the committed GPU references ran: ok, its device recorded, its
    throughput and memory peak measured."""
    run = train(tmp_path, "cuda", "--preset", "tiny", "--steps", "4", "--device", "cuda", "--precision", "bf16",
                "--warmup_steps", "1", "--mem_profile_steps", "1", "--eval_batches", "1").check_ok()
    assert run.config["environment"]["device"].startswith("cuda")
    assert run.summary["samples_per_s"] > 0 and run.summary["mem_peak_bytes"] > 0
