"""DeepSpeed on 2 CPU ranks through the real `deepspeed` launcher and through torchrun.

Parity tolerance: every config here runs DeepSpeed's own optimizer (FusedAdam, or DeepSpeedCPUAdam
when the optimizer is offloaded), not torch's AdamW. Those CPU kernels keep beta^t and the bias
corrections in fp32, where 1 - 0.999^t loses digits (torch computes them in double): measured
here, the per-step losses differ from the single-process reference by at most 1.34e-6 relative
over 10 steps. rtol 1e-5 holds that with room, and is the tolerance of the torch backends.
"""

import subprocess
from pathlib import Path

import pytest
import torch

from backends.deepspeed_support import async_io_available
from ckpt_probe import assert_unchanged
from conftest import PARITY_ARGS, REPO, assert_losses_close, base_env, launch_command, train

STEPS = 10
RTOL = 1e-5
CONFIGS = {  # config -> launcher, micro-batch, accumulation (global batch 8 on 2 ranks)
    "z0": ("deepspeed", 4, 1),
    "z1": ("deepspeed", 4, 1),
    "z2": ("deepspeed", 2, 2),
    "z3": ("deepspeed", 4, 1),
    "z2_offload": ("torchrun", 4, 1),
    "z3_infinity": ("torchrun", 2, 2),
    "zeropp": ("deepspeed", 4, 1),
}
# DeepSpeed JIT-compiles its CPU ops on first use (minutes each on 2 cores); allow for it.
DS_TIMEOUT_S = 900

pytestmark = pytest.mark.distributed


@pytest.fixture
def reference(single_reference):
    return single_reference


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    done = {}

    def run(name):
        if name not in done:
            launcher, micro, accum = CONFIGS[name]
            done[name] = train(runs, name, *PARITY_ARGS, "--deepspeed_config", f"ds_configs/{name}.json",
                               "--steps", str(STEPS), "--micro_batch", str(micro), "--grad_accum", str(accum),
                               "--mem_profile_steps", "1", launcher=launcher, timeout=DS_TIMEOUT_S).check_ok()
        return done[name]

    return run


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_matches_single_process_losses(name, ds_runs, reference):
    run = ds_runs(name)
    assert run.summary["backend"] == "deepspeed" and run.summary["world_size"] == 2
    assert run.summary["global_batch"] == 8 and run.config["launcher"] == CONFIGS[name][0]
    assert_losses_close(run.losses, reference.losses, STEPS, RTOL)


def test_no_shared_memory_buffers_are_left_behind(ds_runs):
    # DeepSpeed's CPU shm allreduce never unlinks its 66 MB /dev/shm buffers; the backend does.
    import os

    run = ds_runs("z2")
    args = run.proc.args
    port = args[args.index("--master_port") + 1] if "--master_port" in args else None
    assert port, args
    left = [p for p in os.listdir("/dev/shm") if p.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in p]
    assert left == []


def test_deepspeed_as_one_process_without_a_launcher(runs_dir, reference):
    run = train(runs_dir, "z2-python", *PARITY_ARGS, "--deepspeed_config", "ds_configs/z2.json",
                "--steps", str(STEPS), "--micro_batch", "8", timeout=DS_TIMEOUT_S).check_ok()
    assert run.summary["world_size"] == 1 and run.config["launcher"] == "python"
    assert_losses_close(run.losses, reference.losses, STEPS, RTOL)


def test_zero3_holds_one_world_th_of_the_parameters(ds_runs):
    summary = ds_runs("z3").summary
    total = summary["n_params"] * 4
    states = summary["model_state_bytes"]
    assert states["params"] == pytest.approx(total / 2, rel=0.05)
    assert ds_runs("z0").summary["model_state_bytes"]["params"] == total


def test_records_deepspeeds_estimate_next_to_the_measurement(ds_runs):
    for name, function in (("z2", "estimate_zero2_model_states_mem_needs"),
                           ("z3", "estimate_zero3_model_states_mem_needs")):
        estimate = ds_runs(name).summary["model_state_estimate"]
        assert estimate["function"].endswith(function) and estimate["device_bytes_per_rank"] > 0
    assert ds_runs("z0").summary["model_state_estimate"]["function"] is None


def test_records_optimizer_offload_and_what_was_not_applied(ds_runs):
    backend = ds_runs("z2_offload").config["backend"]
    assert backend["optimizer"].endswith("DeepSpeedCPUAdam") and backend["offload_optimizer"] == "cpu"
    infinity = ds_runs("z3_infinity").config["backend"]
    assert (infinity["offload_param"], infinity["offload_optimizer"], infinity["zero_stage"]) == ("cpu", "cpu", 3)
    zeropp = ds_runs("zeropp").config["plan"]  # the effective config and what could not apply, decided once
    assert zeropp["config"]["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert any("zero_quantized_weights: not applied" in note for note in zeropp["notes"])


def test_memory_is_measured_under_deepspeed(ds_runs):
    summary = ds_runs("z3").summary
    assert summary["mem_source"] == "torch_profiler" and summary["mem_peak_bytes"] > 0
    assert summary["mem_breakdown"]["activation"] > 0 and summary["mem_breakdown"]["optimizer_state"] > 0


def _probe(tmp_path, config: str, cases: list[str], *extra: str) -> list[dict]:
    cmd = launch_command("torchrun", 2)
    cmd[-1] = str(REPO / "tests" / "ckpt_probe.py")
    cmd += [str(tmp_path), "deepspeed", f"ds_configs/{config}.json", *extra]
    cmd += [arg for case in cases for arg in ("--case", case)]
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=DS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(p) for p in sorted(Path(tmp_path).glob("rank*.pt"))]


def _assert_unchanged(ranks: list[dict], tolerance: float = 1e-6) -> None:
    """Every case has the losses and gradients of the case without checkpointing at its dropout."""
    for results in ranks:
        assert_unchanged(results, list(results), tolerance)


N_LAYER = 4


@pytest.mark.parametrize("config, impls", [
    ("z2", ("deepspeed", "deepspeed_nonreentrant", "torch_nonreentrant", "torch_reentrant")),
    ("z3", ("deepspeed", "torch_nonreentrant", "torch_reentrant")),  # non_reentrant_checkpoint fails on ZeRO-3
])
def test_checkpointing_leaves_losses_and_gradients_unchanged(tmp_path, config, impls):
    cases = ["0:torch_nonreentrant:0"] + [f"{k}:{impl}:0" for impl in impls for k in (1, 2, N_LAYER)]
    cases.append("2:deepspeed:1")  # with --ckpt_offload: DeepSpeed's cpu_checkpointing
    # --ckpt_policy selective, without dropout and with it (the recomputed masks are the forward's);
    # refused under ZeRO-3 (backends/deepspeed_plan.py, test_bad_input.py).
    if config != "z3":
        cases += ["1:torch_nonreentrant:0:selective", "2:torch_nonreentrant:0:selective",
                  "0:torch_nonreentrant:0:full:0.1", "1:torch_nonreentrant:0:selective:0.1",
                  "0:torch_nonreentrant:0:selective+full+none+full:0.1"]
    else:  # a plan of none and full, what --ckpt_policy auto chooses from under ZeRO-3
        cases += ["0:torch_nonreentrant:0:none+full+full+none", "0:torch_nonreentrant:0:full:0.1",
                  "0:torch_nonreentrant:0:full+none+none+full:0.1"]
    ranks = _probe(tmp_path, config, cases)
    _assert_unchanged(ranks)
    if config != "z3":
        assert ranks[0]["1:torch_nonreentrant:0:selective"]["record"]["policy"] == "selective"
    record = ranks[0]["1:deepspeed:0"]
    assert record["record"]["blocks"] == [0, 1, 2, 3] and record["modules"]["DeepSpeedCheckpointed"] == N_LAYER


def test_reentrant_checkpointing_of_a_first_block_whose_input_needs_no_grad(tmp_path):
    # With frozen embeddings, block 0's input needs no gradient: DeepSpeed's reentrant checkpoint
    # then computes no gradients for the checkpointed blocks (DeepSpeed issues 4274, 4479). The
    # suite's wrapper makes the input require grad, so nothing changes against no checkpointing.
    ranks = _probe(tmp_path, "z2", ["0:torch_nonreentrant:0", "1:deepspeed:0", "2:deepspeed:0", "4:deepspeed:0"],
                   "--freeze_embeddings")
    _assert_unchanged(ranks)


@pytest.mark.skipif(not async_io_available(),
                    reason="libaio is not installed, so DeepSpeed's async_io op (NVMe offload) cannot build; "
                           ".ci/run and `make setup` install libaio-dev where apt-get is available")
def test_zero_infinity_nvme_offload_to_a_directory(tmp_path):
    # The small preset: DeepSpeed only swaps tensors of at least 1 MiB to disk.
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    common = ("--preset", "small", "--dropout", "0", "--steps", "3", "--micro_batch", "2", "--lr_warmup_steps", "0",
              "--mem_profile_steps", "0", "--warmup_steps", "0", "--eval_batches", "1")
    reference = train(tmp_path / "runs", "single", *common, "--micro_batch", "4").check_ok()
    run = train(tmp_path / "runs", "nvme", *common, "--deepspeed_config", "ds_configs/z3_infinity_nvme.json",
                "--nvme_path", str(nvme), launcher="torchrun", timeout=DS_TIMEOUT_S).check_ok()
    swapped = list(nvme.rglob("*.swp"))
    assert swapped, "nothing was written to the NVMe directory"
    assert run.config["backend"]["offload_optimizer"] == "nvme"
    assert_losses_close(run.losses, reference.losses, 3, RTOL)
