"""Activation offloading with a prefetch horizon (--offload_activations): the training is unchanged
under every backend, and the schedule is the one promised: each offloaded tensor fetched once,
before the backward that uses it, at most H checkpointed blocks ahead, released after use."""

import pytest
import torch

from backends.activation_checkpointing import checkpointed_indices
from ckpt_probe import case_result, run_case
from gptlite.data import CharDataset
from core.dist import DistEnv
from launches import DS_OFFLOAD_CASES, OFFLOAD_CASES

N_LAYER = 4  # the tiny preset
IMPL = "torch_nonreentrant"
# The probe launch's groups (tests/support/launches.py) with each checkpointed interval without offloading,
# then with prefetch offloading at horizon 2; ZeRO-3 DeepSpeed's reentrant checkpoint too (horizon 1).
BACKENDS = {"ddp": OFFLOAD_CASES, "fsdp": OFFLOAD_CASES, "fsdp2": OFFLOAD_CASES, "z3": OFFLOAD_CASES + DS_OFFLOAD_CASES}


def assert_schedule(schedule: dict) -> None:
    """The offloader's events of one backward obey the prefetch contract."""
    horizon, events = schedule["horizon"], schedule["events"]
    order = list(reversed(schedule["checkpointed"]))  # backward visits the checkpointed blocks last to first
    position = {block: i for i, block in enumerate(order)}
    offloaded = {saved: block for kind, block, _, saved in events if kind == "offload"}
    assert sorted(set(offloaded.values())) == schedule["checkpointed"], "every checkpointed block offloads its inputs"
    last_offload = max(i for i, e in enumerate(events) if e[0] == "offload")
    for saved, block in offloaded.items():
        at = {kind: [i for i, e in enumerate(events) if e[3] == saved and e[0] == kind]
              for kind in ("fetch", "use", "release")}
        assert all(len(indices) == 1 for indices in at.values()), f"block {block}: {at} (once each)"
        fetch, use, release = at["fetch"][0], at["use"][0], at["release"][0]
        assert last_offload < fetch < use < release == use + 1, f"block {block}: fetch, use, release in order"
        during = events[fetch][2]  # the block whose backward was running when the fetch started
        ahead = position[block] - (-1 if during is None else position[during])
        if horizon == 0:  # on demand: fetched by its own block's backward, right when used
            assert ahead == 0 and use == fetch + 1, f"block {block} fetched {ahead} ahead with H=0"
        else:  # prefetched: before its block's backward began, at most H blocks ahead
            assert 1 <= ahead <= horizon, f"block {block} fetched {ahead} blocks ahead, H={horizon}"
    assert schedule["left"] == 0, "nothing left behind after backward"


@pytest.fixture(scope="module")
def data():
    return CharDataset.load(None, block_size=64)


BASE = dict(backend="single", preset="tiny", dropout=0.0, micro_batch=4, lr_warmup_steps=0, seed=7)


@pytest.mark.parametrize("interval", [1, 2, N_LAYER])
@pytest.mark.parametrize("horizon", [0, 1, 2, 4])
@pytest.mark.parametrize("impl", ["torch_nonreentrant", "torch_reentrant"])
def test_schedule_fetches_each_tensor_once_ahead_of_use(data, interval, horizon, impl):
    result = run_case(BASE, interval, impl, f"p{horizon}", DistEnv.from_environment("cpu"), data, False)
    schedule = result["schedule"]
    assert schedule["checkpointed"] == checkpointed_indices(N_LAYER, interval)
    assert_schedule(schedule)
    assert result["record"]["prefetch_offload"]["horizon"] == horizon


def test_horizon_0_fetches_exactly_like_on_demand(data):
    """H=0 and a horizon beyond the number of blocks bracket the behaviour: on demand, every fetch is
    made by the block that needs it; with everything prefetched, all fetches precede the first use."""
    env = DistEnv.from_environment("cpu")
    on_demand = run_case(BASE, 1, IMPL, "p0", env, data, False)["schedule"]["events"]
    kinds = [kind for kind, *_ in on_demand if kind != "offload"]
    assert kinds == ["fetch", "use", "release"] * (len(kinds) // 3)
    eager = run_case(BASE, 1, IMPL, f"p{N_LAYER}", env, data, False)["schedule"]["events"]
    first_use = next(i for i, e in enumerate(eager) if e[0] == "use")
    assert all(i < first_use for i, e in enumerate(eager) if e[0] == "fetch")


def test_single_losses_and_gradients_identical_with_offloading(data):
    env = DistEnv.from_environment("cpu")
    for interval in (1, 2):
        for impl in ("torch_nonreentrant", "torch_reentrant"):
            kept = run_case(BASE, interval, impl, "0", env, data, False)
            offloaded = run_case(BASE, interval, impl, "p2", env, data, False)
            _assert_identical(offloaded, kept, f"single every {interval} {impl}")


def test_grad_accumulation_offloads_each_micro_step_afresh(data):
    result = run_case({**BASE, "micro_batch": 2, "grad_accum": 2}, 1, IMPL, "p2", DistEnv.from_environment("cpu"),
                      data, False)
    assert_schedule(result["schedule"])
    kept = run_case({**BASE, "micro_batch": 2, "grad_accum": 2}, 1, IMPL, "0", DistEnv.from_environment("cpu"),
                    data, False)
    _assert_identical(result, kept, "grad_accum 2")


def _assert_identical(got: dict, expected: dict, what: str) -> None:
    assert got["losses"] == expected["losses"], f"{what}: losses {got['losses']} != {expected['losses']}"
    assert got["grads"].keys() == expected["grads"].keys() and got["grads"]
    for name, grad in got["grads"].items():
        assert torch.equal(grad, expected["grads"][name]), f"{what}: gradient of {name} differs"


@pytest.mark.distributed
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_losses_and_gradients_identical_with_offloading(backend, launches, request):
    cases = BACKENDS[backend]
    ranks = [rank[backend] for rank in launches.get("probe", request)]
    assert len(ranks) == 2
    for rank, results in enumerate(ranks):
        for case in cases:
            if case.endswith(":0"):
                continue
            kept = case.rsplit(":", 1)[0] + ":0"
            _assert_identical(case_result(results, case), case_result(results, kept), f"{backend} rank {rank} {case}")
            assert_schedule(results[case]["schedule"])
            assert results[case]["record"]["prefetch_offload"]["horizon"] == int(case.rsplit(":p", 1)[1])
