"""Every backend trains as one process does: the 2-rank runs of the shared launches (tests/support/launches.py)
against the reference's committed losses (tests/support/reference_losses.json), and the reference launch
itself against them.

Global batch 8 everywhere: the reference's micro-batch 8 in one process, 2 ranks x micro-batch 4, or
2 ranks x 2 x 2-step accumulation. rtol 1e-5: the torch backends repeat the reference to about 1e-7,
DeepSpeed's CPU Adam to 1.34e-6 (it keeps beta^t in fp32; tests/distributed/test_deepspeed.py).
"""

import pytest

from conftest import assert_losses_close, matrix_run
from launches import MATRIX_STEPS, REGENERATE, committed_reference, machine

RTOL = 1e-5
MULTI_RANK = ["ddp", "fsdp.full_shard", "fsdp.shard_grad_op", "fsdp.no_shard", "fsdp.hybrid_shard", "fsdp2.fsdp2",
              "fsdp2.fsdp2_no_reshard", "deepspeed.z0", "deepspeed.z1", "deepspeed.z2", "deepspeed.z3",
              "deepspeed.z2_offload", "deepspeed.z3_infinity", "deepspeed.zeropp"]


@pytest.mark.launch
def test_the_reference_reproduces_its_committed_losses(launches, request):
    """The one-process reference, launched now, repeats the committed losses: bit for bit on the machine
    and torch that wrote them; within the parity tolerance elsewhere (another CPU's kernels round the
    last bits otherwise), saying so."""
    run = launches.get("reference", request)
    committed = committed_reference()
    assert len(committed["losses"]) == len(run.losses)
    if committed["machine"] == machine():
        assert run.losses == committed["losses"] and run.summary["val_loss"] == committed["val_loss"], (
            f"the reference moved; if that is intended: {REGENERATE}")
    else:
        assert_losses_close(run.losses, committed["losses"], len(run.losses), RTOL)
        print(f"committed on {committed['machine']}, run on {machine()}: compared within {RTOL:g}")


@pytest.fixture
def matrix(launches, request):
    return launches.get("matrix", request)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["matrix", "ddp-2x2"])
def test_ddp_on_two_processes_matches_single(name, launches, request):
    """DDP, 2 ranks x micro-batch 4 (the quick matrix's run) and 2 x 2 x 2-step accumulation: the
    reference's losses and validation loss."""
    run = matrix_run(launches.get("matrix", request), "ddp") if name == "matrix" else launches.get(name, request)
    reference = committed_reference()
    assert run.summary["world_size"] == 2 and run.summary["global_batch"] == 8
    assert run.config["launcher"] == "torchrun"
    steps = len(run.losses)
    assert_losses_close(run.losses, reference["losses"][:steps], steps, RTOL)
    if steps == len(reference["losses"]):
        assert run.summary["val_loss"] == pytest.approx(reference["val_loss"], rel=RTOL)


@pytest.mark.distributed
@pytest.mark.parametrize("label", MULTI_RANK)
def test_checkpointing_every_block_leaves_every_backends_losses_unchanged(label, matrix):
    """The quick matrix's runs with every block checkpointed (torch's non-reentrant checkpoint) under each
    multi-rank configuration: the reference's losses, as without checkpointing."""
    run = matrix_run(matrix, label, ckpt=1)
    assert run.config["backend"]["activation_checkpointing"]["blocks"] == [0, 1, 2, 3]
    assert len(run.losses) == MATRIX_STEPS
    assert_losses_close(run.losses, committed_reference()["losses"][:MATRIX_STEPS], MATRIX_STEPS, RTOL)
