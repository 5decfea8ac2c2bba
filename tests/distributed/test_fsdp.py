"""FSDP and FSDP2 through torchrun on 2 CPU ranks: parity with single, and per-rank bytes.

The runs are the suite's shared launches (tests/support/launches.py): the quick matrix's records for the
configurations it has, and launches of their own for the CPU-offload files and for accumulation."""

import pytest

import yaml

from backends import fsdp_config
from launches import HYBRID, QUICK_SPEC, committed_reference
from conftest import assert_losses_close, matrix_run

# The hybrid family outside the quick matrix runs at 4 ranks as 2 nodes of 2 (tests/distributed/test_hybrid.py):
# on one node of 2 it is FULL_SHARD or SHARD_GRAD_OP again.
IN_MATRIX = set(yaml.safe_load(QUICK_SPEC.read_text())["matrix"]["backend"])
FP32_CONFIGS = [p for p in fsdp_config.shipped_configs() if fsdp_config.precision_of(fsdp_config.load(str(p))) == "fp32"
                and (p.stem not in HYBRID or f"fsdp_configs/{p.name}" in IN_MATRIX)]
# Some configs also run with gradient accumulation, which exercises no_sync / requires_gradient_sync.
ACCUMULATED = {"shard_grad_op", "fsdp2"}
RTOL = 1e-5

pytestmark = pytest.mark.distributed


def _label(stem: str) -> str:
    return f"{fsdp_config.load(f'fsdp_configs/{stem}.yaml').backend}.{stem}"


@pytest.fixture(scope="module")
def fsdp_runs(launches, request):
    """Each fp32 shipped config on 2 ranks at global batch 8: the matrix's record, or its own launch
    (`name-2x2`: the accumulating one)."""
    def run(name):
        if name.endswith("-2x2"):
            return launches.get(f"{_label(name[:-4])}-2x2", request)
        label = _label(name)
        if label in ("fsdp.full_shard_offload", "fsdp2.fsdp2_offload", "fsdp.full_shard_tuned"):
            return launches.get(label, request)
        return matrix_run(launches.get("matrix", request), label)

    return run


@pytest.fixture
def reference(launches, request):
    return launches.get("reference", request)


CASES = [p.stem for p in FP32_CONFIGS] + [f"{n}-2x2" for n in sorted(ACCUMULATED)]


@pytest.mark.parametrize("config", CASES)
def test_fp32_config_matches_single_process_losses(config, fsdp_runs):
    run = fsdp_runs(config)
    stem = config.removesuffix("-2x2")
    assert run.summary["backend"] == fsdp_config.load(f"fsdp_configs/{stem}.yaml").backend
    assert run.summary["world_size"] == 2 and run.summary["global_batch"] == 8
    assert run.config["launcher"] == "torchrun"
    steps = len(run.losses)
    assert_losses_close(run.losses, committed_reference()["losses"][:steps], steps, RTOL)


def _param_bytes(run):
    return run.summary["n_params"] * 4


def test_full_shard_holds_one_world_th_of_the_parameters(fsdp_runs):
    states = fsdp_runs("full_shard").summary["model_state_bytes"]
    total = fsdp_runs("full_shard").summary["n_params"] * 4
    assert states["params"] == pytest.approx(total / 2, rel=0.05)
    assert states["grads"] == pytest.approx(total / 2, rel=0.05)
    assert states["optimizer"] == pytest.approx(total, rel=0.05)  # AdamW: 2 x the shard
    assert states["params_gathered"] < 0.15 * total  # only the root unit stays gathered


def test_shard_grad_op_holds_all_parameters_and_sharded_gradients_and_optimizer(fsdp_runs):
    run = fsdp_runs("shard_grad_op")
    states, total = run.summary["model_state_bytes"], _param_bytes(run)
    assert states["params"] + states["params_gathered"] >= total
    assert states["params_gathered"] == pytest.approx(total, rel=0.05)
    assert states["optimizer"] == pytest.approx(total, rel=0.05)


def test_no_shard_holds_everything(fsdp_runs, reference):
    states = fsdp_runs("no_shard").summary["model_state_bytes"]
    assert states["params"] == reference.summary["model_state_bytes"]["params"]
    assert states["optimizer"] == pytest.approx(reference.summary["model_state_bytes"]["optimizer"], rel=0.01)


def test_fsdp2_reshard_after_forward_false_keeps_parameters_gathered(fsdp_runs):
    resharded, kept = fsdp_runs("fsdp2").summary, fsdp_runs("fsdp2_no_reshard").summary
    total = resharded["n_params"] * 4
    assert resharded["model_state_bytes"]["params"] == pytest.approx(total / 2, rel=0.05)
    assert kept["model_state_bytes"]["params_gathered"] > 0.9 * total
    assert resharded["model_state_bytes"]["params_gathered"] < 0.15 * total


def test_records_state_sharding_options_and_cpu_adaptations(fsdp_runs):
    config = fsdp_runs("full_shard_offload").config
    backend = config["backend"]
    assert config["plan"]["cpu_offload"] is True  # the options, recorded once, as the plan
    assert backend["cpu_offload_applied"] is False  # a CPU-only run: parameters already in host memory
    assert any("cpu_offload: not applied" in note for note in backend["notes"])
    hybrid = fsdp_runs("hybrid_shard").config["backend"]
    assert fsdp_runs("hybrid_shard").config["plan"]["sharding_strategy"] == "HYBRID_SHARD"
    assert (hybrid["master_dtype"], hybrid["compute_dtype"], hybrid["reduce_dtype"]) == ("fp32",) * 3


def test_memory_breakdown_is_measured_under_fsdp(fsdp_runs, reference):
    fsdp, single = fsdp_runs("full_shard").summary, reference.summary
    assert fsdp["mem_source"] == "torch_profiler"
    assert fsdp["mem_breakdown"]["activation"] > 0
    # Per-rank micro-batch 4 against 8 in one process: about half the activations.
    assert fsdp["mem_breakdown"]["activation"] == pytest.approx(single["mem_breakdown"]["activation"] / 2, rel=0.1)
    assert fsdp["mem_peak_bytes"] < single["mem_peak_bytes"]
