"""`ddp_zero1` (backends/ddp_zero1.py): DDP with torch's ZeroRedundancyOptimizer, the optimizer state
sharded over the ranks. It trains as DDP trains (same data, same seed: the same losses), and the
estimator and the planner know its memory layout from the backend itself (Backend.memory_layout)."""

import pytest

from backends import BACKEND_NAMES, get_backend
from conftest import assert_losses_close
from estimator.estimate import estimate, estimate_from_record
from gptlite.model import preset

RTOL = 1e-5  # the suite's parity tolerance (tests/distributed/test_parity.py)


def test_the_registry_and_the_cli_know_it():
    from training.cli import build_parser

    assert "ddp_zero1" in BACKEND_NAMES and get_backend("ddp_zero1").name == "ddp_zero1"
    assert build_parser().parse_args(["--backend", "ddp_zero1"]).backend == "ddp_zero1"


@pytest.mark.parametrize("world", [2, 4])
def test_the_estimator_shards_only_the_optimizer_state(world):
    """Parameters and gradients as DDP's, whole on every rank; the AdamW state (and its step counters)
    1/world of DDP's; the peak lower by what that saves at the optimizer step at most."""
    cfg = preset("tiny")
    ddp, zero1 = (estimate(cfg, name, world, 4) for name in ("ddp", "ddp_zero1"))
    assert (zero1.params, zero1.params_gathered, zero1.grads) == (ddp.params, ddp.params_gathered, ddp.grads)
    assert zero1.optimizer == pytest.approx(ddp.optimizer / world, abs=4)
    assert ddp.total_bytes - (ddp.optimizer - zero1.optimizer) <= zero1.total_bytes < ddp.total_bytes


@pytest.mark.distributed
def test_it_trains_as_ddp_does_and_holds_a_shard_of_the_optimizer_state(launches, request):
    ddp, zero1 = (launches.get(name, request) for name in ("ddp-2x2", "ddp_zero1-2x2"))
    assert zero1.config["run"]["backend"] == "ddp_zero1" and zero1.summary["world_size"] == 2
    steps = len(ddp.losses)
    assert_losses_close(zero1.losses, ddp.losses, steps, RTOL)
    measured = {name: run.summary["model_state_bytes"] for name, run in (("ddp", ddp), ("zero1", zero1))}
    # Each rank steps half the parameters: half DDP's Adam state (the record is rank 0's).
    assert measured["zero1"]["optimizer"] == pytest.approx(measured["ddp"]["optimizer"] / 2, rel=0.05)
    assert measured["zero1"]["params"] == measured["ddp"]["params"]
    # The estimator reads the record and the backend's layout: within the suite's 5% of the record's states.
    est = estimate_from_record(zero1.config)
    states = sum(measured["zero1"][k] for k in ("params", "params_gathered", "grads", "optimizer"))
    assert est.model_states_bytes == pytest.approx(states, rel=0.05)
    assert est.optimizer == pytest.approx(measured["zero1"]["optimizer"], rel=0.05)


def test_the_projection_prices_it_by_name_with_ddps_traffic_and_a_shard_of_the_optimizer():
    """analysis.project (and the planner's pricing, price_comm) take it by name: DDP's all-reduce, the
    updated parameters broadcast from their owners, and less memory than DDP's at 8 GPUs."""
    import yaml

    from analysis.project import HARDWARE, Assumptions, project

    hw = yaml.safe_load(HARDWARE.read_text())
    run = ["--preset", "tiny", "--micro_batch", "1", "--precision", "bf16", "--attention", "sdpa"]
    ddp, zero1 = (project(name, run, 8, hw["gpus"]["H100-SXM"], hw["networks"]["infiniband-ndr"],
                          hw["nvlink_latency_us"], Assumptions()) for name in ("ddp", "ddp_zero1"))
    assert zero1["config"] == "ddp_zero1" and zero1["memory GiB"] < ddp["memory GiB"]
    assert zero1["comm GiB/step"] > ddp["comm GiB/step"]  # the broadcast of the updated parameters
