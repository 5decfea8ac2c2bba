"""DeepSpeed on 2 CPU ranks through the real `deepspeed` launcher and through torchrun.

Parity tolerance: every config here runs DeepSpeed's own optimizer (FusedAdam, or DeepSpeedCPUAdam
when the optimizer is offloaded), not torch's AdamW. Those CPU kernels keep beta^t and the bias
corrections in fp32, where 1 - 0.999^t loses digits (torch computes them in double): measured
here, the per-step losses differ from the single-process reference by at most 1.34e-6 relative
over 10 steps. rtol 1e-5 holds that with room, and is the tolerance of the torch backends.
"""

import pytest

from backends.deepspeed_support import async_io_available
from ckpt_probe import assert_unchanged
from launches import committed_reference
from conftest import PARITY_ARGS, assert_losses_close, matrix_run, train
from launches import DS_TIMEOUT_S

RTOL = 1e-5
STEPS = 10
# Every shipped ZeRO config (the quick matrix's records: the deepspeed launcher, micro-batch 4), and two
# of them again with 2-step accumulation, one through torchrun (launches of their own).
CONFIGS = ["z0", "z1", "z2", "z3", "z2_offload", "z3_infinity", "zeropp", "z2-2x2", "z3_infinity-2x2"]



@pytest.fixture(scope="module")
def ds_runs(launches, request):
    def run(name):
        if name.endswith("-2x2"):
            return launches.get(name, request)
        return matrix_run(launches.get("matrix", request), f"deepspeed.{name}")

    return run


@pytest.mark.distributed
@pytest.mark.parametrize("name", CONFIGS)
def test_config_matches_single_process_losses(name, ds_runs):
    run = ds_runs(name)
    assert run.summary["backend"] == "deepspeed" and run.summary["world_size"] == 2
    assert run.summary["global_batch"] == 8
    assert run.config["launcher"] == ("torchrun" if name == "z3_infinity-2x2" else "deepspeed")
    steps = len(run.losses)
    assert_losses_close(run.losses, committed_reference()["losses"][:steps], steps, RTOL)


@pytest.mark.distributed
def test_no_shared_memory_buffers_are_left_behind(ds_runs):
    # DeepSpeed's CPU shm allreduce never unlinks its 66 MB /dev/shm buffers; the backend does.
    import os

    run = ds_runs("z2-2x2")  # launched by this test run with the deepspeed launcher on its own port
    args = run.proc.args
    port = args[args.index("--master_port") + 1] if "--master_port" in args else None
    assert port, args
    left = [p for p in os.listdir("/dev/shm") if p.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in p]
    assert left == []


@pytest.mark.launch
def test_deepspeed_as_one_process_without_a_launcher(runs_dir):
    run = train(runs_dir, "z2-python", *PARITY_ARGS, "--deepspeed_config", "ds_configs/z2.json",
                "--steps", str(STEPS), "--micro_batch", "8", timeout=DS_TIMEOUT_S).check_ok()
    assert run.summary["world_size"] == 1 and run.config["launcher"] == "python"
    assert_losses_close(run.losses, committed_reference()["losses"], STEPS, RTOL)


@pytest.mark.distributed
def test_zero3_holds_one_world_th_of_the_parameters(ds_runs):
    summary = ds_runs("z3").summary
    total = summary["n_params"] * 4
    states = summary["model_state_bytes"]
    assert states["params"] == pytest.approx(total / 2, rel=0.05)
    assert ds_runs("z0").summary["model_state_bytes"]["params"] == total


@pytest.mark.distributed
def test_records_deepspeeds_estimate_next_to_the_measurement(ds_runs):
    for name, function in (("z2", "estimate_zero2_model_states_mem_needs"),
                           ("z3", "estimate_zero3_model_states_mem_needs")):
        estimate = ds_runs(name).summary["model_state_estimate"]
        assert estimate["function"].endswith(function) and estimate["device_bytes_per_rank"] > 0
    assert ds_runs("z0").summary["model_state_estimate"]["function"] is None


@pytest.mark.distributed
def test_records_optimizer_offload_and_what_was_not_applied(ds_runs):
    backend = ds_runs("z2_offload").config["backend"]
    assert backend["optimizer"].endswith("DeepSpeedCPUAdam") and backend["offload_optimizer"] == "cpu"
    infinity = ds_runs("z3_infinity").config["backend"]
    assert (infinity["offload_param"], infinity["offload_optimizer"], infinity["zero_stage"]) == ("cpu", "cpu", 3)
    zeropp = ds_runs("zeropp").config["plan"]  # the effective config and what could not apply, decided once
    assert zeropp["config"]["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert any("zero_quantized_weights: not applied" in note for note in zeropp["notes"])


@pytest.mark.distributed
def test_memory_is_measured_under_deepspeed(ds_runs):
    summary = ds_runs("z3").summary
    assert summary["mem_source"] == "torch_profiler" and summary["mem_peak_bytes"] > 0
    assert summary["mem_breakdown"]["activation"] > 0 and summary["mem_breakdown"]["optimizer_state"] > 0


@pytest.fixture
def probe(launches, request):
    """The shared probe launch (tests/support/launches.py PROBE_GROUPS): each rank's results by group."""
    return launches.get("probe", request)


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["z2", "z3"])
def test_checkpointing_leaves_losses_and_gradients_unchanged(probe, config):
    """Every DeepSpeed and torch checkpointing implementation, every 1, 2 and 4 blocks, DeepSpeed's
    cpu_checkpointing, selective and plans (ZeRO-2; ZeRO-3 plans of none and full): the losses and
    first-step gradients of no checkpointing."""
    for rank in probe:
        results = rank[config]
        assert_unchanged(results, [c for c in results if c != "0:torch_nonreentrant:0"], 1e-6, config)
    results = probe[0][config]
    if config != "z3":
        assert results["1:torch_nonreentrant:0:selective"]["record"]["policy"] == "selective"
    record = results["1:deepspeed:0"]
    assert record["record"]["blocks"] == [0, 1, 2, 3] and record["modules"]["DeepSpeedCheckpointed"] == N_LAYER


@pytest.mark.distributed
def test_reentrant_checkpointing_of_a_first_block_whose_input_needs_no_grad(probe):
    # With frozen embeddings, block 0's input needs no gradient: DeepSpeed's reentrant checkpoint
    # then computes no gradients for the checkpointed blocks (DeepSpeed issues 4274, 4479). The
    # suite's wrapper makes the input require grad, so nothing changes against no checkpointing.
    for rank in probe:
        results = rank["z2.frozen"]
        assert_unchanged(results, [c for c in results if c != "0:torch_nonreentrant:0"], 1e-6, "z2.frozen")


N_LAYER = 4


@pytest.mark.skipif(not async_io_available(),
                    reason="libaio is not installed, so DeepSpeed's async_io op (NVMe offload) cannot build; "
                           ".ci/run and `make setup` install libaio-dev where apt-get is available")
@pytest.mark.distributed
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
