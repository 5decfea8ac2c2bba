"""Activation checkpointing every k-th block under single, ddp, fsdp and fsdp2."""

import subprocess

import pytest
import torch
import torch.nn as nn

from backends.activation_checkpointing import checkpointed_indices
from core.config import CKPT_IMPLS, DEEPSPEED_CKPT_IMPLS
from ckpt_probe import assert_unchanged, baseline_of, parse_case
from conftest import LAUNCH_TIMEOUT_S, REPO, base_env, launch_command, train

PROBE = REPO / "tests" / "ckpt_probe.py"
N_LAYER = 4  # the tiny preset
IMPLS = ("torch_nonreentrant", "torch_reentrant")
INTERVALS = (1, 2, N_LAYER)
BASELINE = "0:torch_nonreentrant:0"
CASES = [BASELINE] + [f"{k}:{impl}:0" for impl in IMPLS for k in INTERVALS] + ["1:torch_nonreentrant:1",
                                                                                  "2:torch_reentrant:1"]
# --ckpt_policy selective, without dropout and with it: a recompute draws the forward's dropout masks.
CASES += ["1:torch_nonreentrant:0:selective", "2:torch_nonreentrant:0:selective",
          "0:torch_nonreentrant:0:full:0.1", "1:torch_nonreentrant:0:full:0.1", "1:torch_nonreentrant:0:selective:0.1"]
# A plan per block (--ckpt_plan, what --ckpt_policy auto runs), without dropout and with it.
CASES += ["0:torch_nonreentrant:0:selective+full+none+full", "0:torch_nonreentrant:0:full+none+selective+selective:0.1"]
TOLERANCE = 1e-6

BACKENDS = {
    "single": ("python", []),
    "ddp": ("torchrun", []),
    "fsdp": ("torchrun", ["fsdp_configs/full_shard.yaml"]),
    "fsdp2": ("torchrun", ["fsdp_configs/fsdp2.yaml"]),
}


def test_checkpointed_blocks_are_every_kth_from_the_first():
    assert checkpointed_indices(6, 0) == []
    assert checkpointed_indices(6, 1) == [0, 1, 2, 3, 4, 5]
    assert checkpointed_indices(6, 2) == [0, 2, 4]
    assert checkpointed_indices(6, 4) == [0, 4]
    assert checkpointed_indices(6, 6) == [0]


@pytest.fixture(scope="module", params=list(BACKENDS))
def probe(request, tmp_path_factory):
    backend = request.param
    launcher, extra = BACKENDS[backend]
    out = tmp_path_factory.mktemp(f"probe-{backend}")
    cmd = [*launch_command(launcher, 2)]
    cmd[-1] = str(PROBE)  # the launcher's script: the probe instead of train.py
    cmd += [str(out), backend, *extra, *(arg for case in CASES for arg in ("--case", case))]
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = sorted(out.glob("rank*.pt"))
    assert len(ranks) == (1 if launcher == "python" else 2)
    return backend, [torch.load(path) for path in ranks]


@pytest.mark.distributed
def test_checkpointing_leaves_losses_and_gradients_unchanged(probe):
    backend, ranks = probe
    for results in ranks:
        assert results[BASELINE]["record"]["blocks"] == []
        for case in CASES[1:]:
            got, base = results[case], results[baseline_of(case)]
            interval, *_, policy, dropout = parse_case(case)
            if "+" in policy:  # a plan
                assert got["record"]["plan"] == policy.split("+") and got["record"]["policy"] == "plan"
                assert got["record"]["blocks"] == [i for i, c in enumerate(policy.split("+")) if c != "none"]
                assert got["modules"]["CheckpointWrapper"] == len(got["record"]["blocks"])
            else:
                assert got["record"]["blocks"] == checkpointed_indices(N_LAYER, interval)
                assert got["record"]["policy"] == (policy if interval else None)
            if dropout:  # the dropout runs differ from the runs without it
                assert got["losses"] != results[BASELINE]["losses"]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(base["losses"]),
                                       rtol=TOLERANCE, atol=TOLERANCE, msg=f"{backend} {case} losses")
            assert got["grads"].keys() == base["grads"].keys() and got["grads"]
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, base["grads"][name], rtol=TOLERANCE, atol=TOLERANCE,
                                           msg=f"{backend} {case} gradient of {name}")


@pytest.mark.distributed
def test_printed_model_shows_checkpoint_wrappers_where_chosen(probe):
    backend, ranks = probe
    results = ranks[0]
    assert results["2:torch_reentrant:0"]["modules"]["CheckpointWrapper"] == len(checkpointed_indices(N_LAYER, 2))
    assert "CheckpointWrapper" not in results[BASELINE]["modules"]
    offloaded = results["1:torch_nonreentrant:1"]["modules"]
    assert offloaded["OffloadWrapper"] == offloaded["CheckpointWrapper"] == N_LAYER
    printed = results["2:torch_reentrant:0"]["model"]
    assert "CheckpointWrapper" in printed and "CheckpointWrapper" not in results[BASELINE]["model"]
    if backend == "fsdp":
        # Shard first, then wrap: each checkpoint wrapper sits inside its block's FSDP unit.
        units = printed.split("(0): FullyShardedDataParallel(")[1]
        assert units.lstrip().startswith("(_fsdp_wrapped_module): CheckpointWrapper(")


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    common = ("--preset", "small", "--steps", "2", "--micro_batch", "4", "--warmup_steps", "0",
              "--mem_profile_steps", "1", "--eval_batches", "1")
    return {k: train(runs, f"small-ckpt{k}", *common, "--ckpt_interval", str(k)).check_ok() for k in (0, 1)}


def test_interval_1_at_least_halves_activation_bytes_at_the_peak(small_runs):
    off, on = (small_runs[k].summary for k in (0, 1))
    assert on["mem_breakdown"]["activation"] <= 0.5 * off["mem_breakdown"]["activation"]
    assert on["mem_peak_bytes"] < off["mem_peak_bytes"]
    assert on["ckpt_interval"] == 1 and off["ckpt_interval"] == 0


def test_run_record_says_which_blocks_were_checkpointed_and_how(small_runs):
    record = small_runs[1].config["backend"]["activation_checkpointing"]
    assert record == {"interval": 1, "impl": "torch_nonreentrant", "offload": False, "prefetch_offload": None,
                      "blocks": [0, 1, 2, 3, 4, 5], "policy": "full", "save_ops": None, "plan": ["full"] * 6}
    assert small_runs[0].config["backend"]["activation_checkpointing"]["blocks"] == []


class _BatchNormNet(nn.Module):
    """A small convolutional net of repeated blocks with BatchNorm (running statistics in buffers)."""

    def __init__(self, n_blocks: int = 3, width: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))
            for _ in range(n_blocks))
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x.mean((2, 3)))


def _train_bn_net(impl: str | None, offload: bool = False, steps: int = 4):
    """Buffers and validation loss of `_BatchNormNet` after `steps` SGD steps, its blocks checkpointed
    with `impl` (None: not checkpointed; "selective": torch's non-reentrant, --ckpt_policy selective)."""
    policy = "selective" if impl == "selective" else "full"
    impl = "torch_nonreentrant" if impl == "selective" else impl
    from backends.activation_checkpointing import apply_ac
    from backends.activation_offload import ActivationOffloader, attach

    torch.manual_seed(0)
    net = _BatchNormNet()
    blocks = list(net.blocks)
    wrapper = None
    if impl in DEEPSPEED_CKPT_IMPLS:
        from backends.deepspeed_support import deepspeed_wrapper

        wrapper = deepspeed_wrapper(impl)
    offloader = None
    if offload:
        offloader = ActivationOffloader(torch.device("cpu"), 1, checkpointed_indices(len(blocks), 1))
        attach(net, offloader)
    apply_ac(net, blocks, 1 if impl else 0, impl or "torch_nonreentrant", False, wrapper=wrapper, offloader=offloader,
             policy=policy)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 3, 8, 8, generator=data), torch.randint(0, 5, (4,), generator=data)
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    net.eval()
    with torch.no_grad():
        x, y = torch.randn(8, 3, 8, 8, generator=data), torch.randint(0, 5, (8,), generator=data)
        val = nn.functional.cross_entropy(net(x), y).item()
    return {name.replace("_checkpoint_wrapped_module.", "").replace("module.", ""): b.clone()
            for name, b in net.named_buffers()}, val


@pytest.mark.parametrize("impl, offload", [(impl, False) for impl in CKPT_IMPLS] + [("torch_nonreentrant", True),
                                                                                    ("selective", False)])
def test_recompute_leaves_batchnorm_statistics_and_validation_loss_unchanged(impl, offload):
    """A checkpoint's recompute runs the block again in training mode: BatchNorm's running statistics
    and num_batches_tracked must be updated once per forward, as without checkpointing."""
    plain_buffers, plain_val = _train_bn_net(None)
    buffers, val = _train_bn_net(impl, offload)
    assert buffers.keys() == plain_buffers.keys() and buffers
    for name, value in buffers.items():
        if name.endswith("num_batches_tracked"):
            assert value.item() == plain_buffers[name].item() == 4, f"{impl}: {name} {value.item()}"
        torch.testing.assert_close(value, plain_buffers[name], rtol=0, atol=0, msg=f"{impl}: {name}")
    assert val == plain_val


def test_reentrant_checkpointing_of_a_block_fed_by_data_trains_its_parameters():
    """A first block whose input needs no gradient (images, a vision model's first convolution):
    torch's reentrant checkpoint then made no gradient for its parameters."""
    from backends.activation_checkpointing import apply_ac

    def grads(impl):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
        apply_ac(net, [net[0], net[2]], 1 if impl else 0, impl or "torch_nonreentrant", False)
        net(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
        return [p.grad for p in net.parameters()]

    plain = grads(None)
    for impl in ("torch_reentrant", "torch_nonreentrant"):
        got = grads(impl)
        assert all(g is not None for g in got), impl
        for g, expected in zip(got, plain):
            torch.testing.assert_close(g, expected, msg=impl)


def _backward_flops_by_op(interval: int, policy: str = "full", save_ops=None) -> dict:
    """FLOPs of one backward of GPT-lite tiny (naive attention) by aten op (torch's FlopCounterMode):
    a checkpoint's recompute runs inside the backward, so what it runs again is counted there."""
    from torch.utils.flop_counter import FlopCounterMode

    from backends.activation_checkpointing import apply_ac
    from core.blocks import find_blocks
    from core.config import RunConfig
    from gptlite.model import build_model

    model = build_model(RunConfig(preset="tiny", dropout=0.0).model_config(vocab_size=65), 0)
    apply_ac(model, find_blocks(model, None), interval, "torch_nonreentrant", False, policy=policy, save_ops=save_ops)
    idx = torch.randint(0, 65, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = model(idx, idx)[-1]
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def test_a_selective_checkpoint_recomputes_only_the_ops_it_does_not_keep():
    """Full checkpointing runs every block's forward again in backward; selective keeps the weight
    matmuls' outputs (mm, addmm) and recomputes the naive attention core (bmm: QK^T and AV); keeping
    bmm too (--ckpt_save_ops) recomputes no FLOP at all. The FLOP count of the run record
    (core/flops.py, recomputed) says the same."""
    from backends.activation_checkpointing import SELECTIVE_SAVE_OPS
    from core.flops import counted_flops
    from core.blocks import find_blocks
    from core.config import RunConfig
    from gptlite.model import build_model

    none, full = _backward_flops_by_op(0), _backward_flops_by_op(1)
    selective = _backward_flops_by_op(1, "selective")
    every_matmul = _backward_flops_by_op(1, "selective", ("mm", "addmm", "bmm"))
    assert full["aten.mm"] > none["aten.mm"] and full["aten.bmm"] > none["aten.bmm"]
    assert selective["aten.mm"] == none["aten.mm"] and selective.get("aten.addmm") == none.get("aten.addmm")
    assert selective["aten.bmm"] > none["aten.bmm"]
    assert every_matmul == none
    # The record's recomputed FLOPs against what the backward measured above. Selective: exactly.
    # Full: an upper bound, by the block's last matmul: torch's non-reentrant checkpoint stops its
    # recompute once it has what backward needs (early stop), and nothing keeps the last op's output.
    model = build_model(RunConfig(preset="tiny", dropout=0.0).model_config(vocab_size=65), 0)
    idx = torch.randint(0, 65, (2, 64), generator=torch.Generator().manual_seed(0))
    blocks = {f"blocks.{i}": b for i, b in enumerate(find_blocks(model, None))}
    recomputed = {}
    for policy, kept, measured in (("full", (), full), ("selective", SELECTIVE_SAVE_OPS, selective)):
        _, per_block = counted_flops(model, idx, idx, modules=blocks, kept_ops=kept)
        recomputed[policy] = (sum(per_block.values()), sum(measured.values()) - sum(none.values()))
    assert recomputed["selective"][0] == recomputed["selective"][1] > 0
    assert recomputed["full"][0] >= recomputed["full"][1] > 2 * recomputed["selective"][1]


# The rest of the quick matrix (sweeps/cpu_quick.yaml) and accelerate: a plan per block (what
# --ckpt_policy auto runs) leaves losses and gradients unchanged, with dropout 0.1 too. Selective
# blocks except under ZeRO-3, where plans hold none and full (backends/deepspeed_plan.py).
PLAN_CASES = ["0:torch_nonreentrant:0", "0:torch_nonreentrant:0:full:0.1",
              "0:torch_nonreentrant:0:selective+full+none+full", "0:torch_nonreentrant:0:full+none+selective+full:0.1"]
ZERO3_PLAN_CASES = ["0:torch_nonreentrant:0", "0:torch_nonreentrant:0:full:0.1",
                    "0:torch_nonreentrant:0:none+full+full+none", "0:torch_nonreentrant:0:full+none+full+full:0.1"]
MORE_BACKENDS = {
    "fsdp.shard_grad_op": ("torchrun", "fsdp", "fsdp_configs/shard_grad_op.yaml", PLAN_CASES),
    "fsdp.no_shard": ("torchrun", "fsdp", "fsdp_configs/no_shard.yaml", PLAN_CASES),
    "fsdp.hybrid_shard": ("torchrun", "fsdp", "fsdp_configs/hybrid_shard.yaml", PLAN_CASES),
    "fsdp2.no_reshard": ("torchrun", "fsdp2", "fsdp_configs/fsdp2_no_reshard.yaml", PLAN_CASES),
    "accelerate": ("torchrun", "accelerate", None, PLAN_CASES),
    "z0": ("torchrun", "deepspeed", "ds_configs/z0.json", PLAN_CASES),
    "z1": ("torchrun", "deepspeed", "ds_configs/z1.json", PLAN_CASES),
    "z2_offload": ("torchrun", "deepspeed", "ds_configs/z2_offload.json", PLAN_CASES),
    "zeropp": ("torchrun", "deepspeed", "ds_configs/zeropp.json", ZERO3_PLAN_CASES),
    "z3_infinity": ("torchrun", "deepspeed", "ds_configs/z3_infinity.json", ZERO3_PLAN_CASES),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MORE_BACKENDS))
def test_a_plan_leaves_losses_and_gradients_unchanged_on_the_rest_of_the_quick_matrix(name, tmp_path):
    launcher, backend, config, cases = MORE_BACKENDS[name]
    cmd = [*launch_command(launcher, 2)]
    cmd[-1] = str(PROBE)
    cmd += [str(tmp_path), backend, *([config] if config else []), *(arg for case in cases for arg in ("--case", case))]
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(path) for path in sorted(tmp_path.glob("rank*.pt"))]
    assert len(ranks) == 2
    for results in ranks:
        for case in cases[2:]:
            plan = parse_case(case)[3].split("+")
            record = results[case]["record"]
            assert record["plan"] == plan and record["blocks"] == [i for i, c in enumerate(plan) if c != "none"]
        assert_unchanged(results, cases[2:], TOLERANCE, name)
