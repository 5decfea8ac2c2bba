"""Activation checkpointing every k-th block under single, ddp, fsdp and fsdp2."""

import pytest
import torch
import torch.nn as nn

from backends.activation_checkpointing import checkpointed_indices
from core.config import CKPT_IMPLS, DEEPSPEED_CKPT_IMPLS
from ckpt_probe import assert_unchanged, baseline_of, case_result, parse_case, run_case
from conftest import train
from launches import CKPT_BASELINE as BASELINE, CKPT_CASES as CASES, PLAN_CASES, PROBE_GROUPS, ZERO3_PLAN_CASES

N_LAYER = 4  # the tiny preset
TOLERANCE = 1e-6
# The 2-rank backends of the probe launch (tests/support/launches.py) with the full set of cases; single runs
# the same cases in this process.
BACKENDS = ["ddp", "fsdp", "fsdp2"]
MORE_BACKENDS = [g["label"] for g in PROBE_GROUPS if g["cases"] in (PLAN_CASES, ZERO3_PLAN_CASES)]


def test_checkpointed_blocks_are_every_kth_from_the_first():
    assert checkpointed_indices(6, 0) == []
    assert checkpointed_indices(6, 1) == [0, 1, 2, 3, 4, 5]
    assert checkpointed_indices(6, 2) == [0, 2, 4]
    assert checkpointed_indices(6, 4) == [0, 4]
    assert checkpointed_indices(6, 6) == [0]


@pytest.fixture(scope="module")
def single_probe():
    """The probe's cases for the one-process backend, run in this process (as tests/support/ckpt_probe.py would)."""
    from core.dist import DistEnv
    from gptlite.data import CharDataset

    base = dict(backend="single", preset="tiny", dropout=0.0, micro_batch=4, grad_accum=1, lr_warmup_steps=0, seed=7)
    data, env = CharDataset.load(None, block_size=64), DistEnv.from_environment("cpu")
    results = {}
    for case in CASES:
        interval, impl, offload, policy, dropout = parse_case(case)
        results[case] = run_case(base, interval, impl, offload, env, data, False, policy, dropout)
    return [results]


def _check_unchanged(backend, ranks):
    for results in ranks:
        assert case_result(results, BASELINE)["record"]["blocks"] == []
        for case in CASES[1:]:
            got, base = case_result(results, case), case_result(results, baseline_of(case))
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


def _check_wrappers(backend, ranks):
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


def test_one_process_checkpointing_leaves_losses_and_gradients_unchanged(single_probe):
    _check_unchanged("single", single_probe)
    _check_wrappers("single", single_probe)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpointing_leaves_losses_and_gradients_unchanged(backend, launches, request):
    _check_unchanged(backend, [rank[backend] for rank in launches.get("probe", request)])


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_printed_model_shows_checkpoint_wrappers_where_chosen(backend, launches, request):
    _check_wrappers(backend, [rank[backend] for rank in launches.get("probe", request)])


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    common = ("--preset", "small", "--steps", "2", "--micro_batch", "4", "--warmup_steps", "0",
              "--mem_profile_steps", "1", "--eval_batches", "1")
    return {k: train(runs, f"small-ckpt{k}", *common, "--ckpt_interval", str(k)).check_ok() for k in (0, 1)}


@pytest.mark.launch
def test_interval_1_at_least_halves_activation_bytes_at_the_peak(small_runs):
    off, on = (small_runs[k].summary for k in (0, 1))
    assert on["mem_breakdown"]["activation"] <= 0.5 * off["mem_breakdown"]["activation"]
    assert on["mem_peak_bytes"] < off["mem_peak_bytes"]
    assert on["ckpt_interval"] == 1 and off["ckpt_interval"] == 0


@pytest.mark.launch
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


@pytest.mark.distributed
@pytest.mark.parametrize("name", MORE_BACKENDS)
def test_a_plan_leaves_losses_and_gradients_unchanged_on_the_rest_of_the_quick_matrix(name, launches, request):
    """The rest of the quick matrix (sweeps/cpu_quick.yaml) and accelerate: a plan per block (what
    --ckpt_policy auto runs) leaves losses and gradients unchanged, with dropout 0.1 too. Selective
    blocks except under ZeRO-3, where plans hold none and full (backends/deepspeed_spec.py)."""
    ranks = [rank[name] for rank in launches.get("probe", request)]
    cases = list(ranks[0])
    assert len(ranks) == 2 and len(cases) == 4
    for results in ranks:
        for case in cases[2:]:
            plan = parse_case(case)[3].split("+")
            record = case_result(results, case)["record"]
            assert record["plan"] == plan and record["blocks"] == [i for i, c in enumerate(plan) if c != "none"]
        assert_unchanged(results, cases[2:], TOLERANCE, name)
