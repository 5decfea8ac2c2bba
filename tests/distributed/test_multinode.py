"""Two torchrun node launchers on one machine (--nnodes 2, c10d rendezvous on 127.0.0.1)."""

import subprocess
import sys
import uuid

import pytest

from conftest import LAUNCH_TIMEOUT_S, PARITY_ARGS, REPO, TRAIN, Run, assert_losses_close, base_env
from core.ports import free_port
from launches import committed_reference

pytestmark = pytest.mark.distributed
STEPS = 6


@pytest.fixture
def reference():
    """The reference's first STEPS steps (global batch 8; committed: tests/support/reference_losses.json)."""
    return committed_reference()["losses"][:STEPS]


@pytest.mark.parametrize("backend_args", [("--backend", "ddp"), ("--fsdp_config", "fsdp_configs/full_shard.yaml")],
                         ids=["ddp", "fsdp"])
def test_two_node_launchers_train_like_one_process(tmp_path, reference, backend_args):
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
         "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
         str(TRAIN), "--runs_dir", str(tmp_path), "--run_name", "two-nodes", "--quiet", *PARITY_ARGS, *backend_args,
         "--steps", str(STEPS), "--micro_batch", "4"],
        cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = [node.communicate(timeout=LAUNCH_TIMEOUT_S) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    run = Run(subprocess.CompletedProcess([], 0, "", ""), tmp_path / "two-nodes").check_ok()
    assert run.summary["world_size"] == 2 and run.config["launcher"] == "torchrun"
    assert_losses_close(run.losses, reference, STEPS, 1e-5)
