"""--compile: compiled training matches eager training of the same backend, with and without
checkpointing, through the real launchers.

Compile backends: inductor (generated kernels, what users run) for single with and without
checkpointing, DDP with checkpointing and FSDP2 without; aot_eager (dynamo's capture and
AOTAutograd, the same graphs without code generation) for the rest, which keeps the suite's time:
an inductor compile costs 10-30 s per run on 2 cores. Tolerance: the parity tests' rtol 1e-5;
measured, aot_eager repeats eager bit for bit and inductor differs by about 1e-7.
"""

import pytest

from conftest import PARITY_ARGS, assert_losses_close, train

STEPS = 4
RTOL = 1e-5
ARGS = (*PARITY_ARGS, "--steps", str(STEPS), "--warmup_steps", "1")  # the first step compiles
BACKENDS = {  # name -> (flags, launcher): global batch 8 everywhere, the reference's
    "single": (("--micro_batch", "8"), "python"),
    "ddp": (("--backend", "ddp", "--micro_batch", "4"), "torchrun"),
    "fsdp": (("--fsdp_config", "fsdp_configs/full_shard.yaml", "--micro_batch", "4"), "torchrun"),
    "fsdp2": (("--fsdp_config", "fsdp_configs/fsdp2.yaml", "--micro_batch", "4"), "torchrun"),
    "z1": (("--deepspeed_config", "ds_configs/z1.json", "--micro_batch", "4"), "deepspeed"),
    "z3": (("--deepspeed_config", "ds_configs/z3.json", "--micro_batch", "4"), "deepspeed"),
}
INDUCTOR = {("single", 0), ("single", 1), ("ddp", 1), ("fsdp2", 0)}
CASES = [(name, interval) for name in BACKENDS for interval in (0, 1)]


def _tier(name):
    return pytest.mark.launch if name == "single" else pytest.mark.distributed


@pytest.fixture
def eager(launches, request):
    """Eager training at the same global batch: the reference launch (tests/support/launches.py). Every
    backend and checkpointing repeats its losses within 1e-5 (tests/distributed/test_parity.py), so it is the
    eager run of each."""
    return launches.get("reference", request)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    runs, done = tmp_path_factory.mktemp("compiled"), {}

    def get(name, interval):
        if (name, interval) not in done:
            flags, launcher = BACKENDS[name]
            backend = "inductor" if (name, interval) in INDUCTOR else "aot_eager"
            # single's inductor run is also test_a_compile_memory_budget's run at torch's default budget
            profiled = ("--mem_profile_steps", "1") if (name, interval) == ("single", 0) else ()
            done[name, interval] = train(runs, f"{name}-ckpt{interval}-compiled", *ARGS, *flags, *profiled,
                                         "--ckpt_interval", str(interval), "--compile", "--compile_backend", backend,
                                         launcher=launcher, timeout=900).check_ok()
        return done[name, interval]

    return get


@pytest.mark.parametrize("name, interval", [pytest.param(n, i, marks=_tier(n)) for n, i in CASES],
                         ids=[f"{n}-ckpt{i}" for n, i in CASES])
def test_compiled_run_matches_eager(name, interval, eager, compiled):
    backend = "inductor" if (name, interval) in INDUCTOR else "aot_eager"
    run = compiled(name, interval)
    assert_losses_close(run.losses, eager.losses[:STEPS], STEPS, RTOL)
    record = run.config["backend"]["compile"]
    assert record["backend"] == backend and "blocks" in record["target"]
    stats = run.summary["compile"]
    assert stats["graphs"] >= 1 and stats["compile_s"] > 0
    if name != "z3":
        # Hooks stay outside the compiled forward: nothing breaks the block's graph. (ZeRO-3 fetches
        # each layer's parameters in hooks on the block's children, which DeepSpeed keeps out of
        # dynamo: the record counts those breaks, as for any model a user brings.)
        assert stats["graph_breaks"] == 0, stats
    assert run.config["backend"]["activation_checkpointing"]["interval"] == interval


@pytest.mark.launch
def test_an_eager_run_records_no_compilation(eager):
    run = eager
    assert run.summary["compile"] is None and run.config["backend"]["compile"] is None


@pytest.mark.launch
def test_a_compile_memory_budget_recomputes_inside_the_compiled_blocks(eager, compiled, tmp_path):
    """--compile_memory_budget 0 (inductor): the losses of eager training (dropout 0: PARITY_ARGS), far
    fewer activation bytes at the peak than the compiled run with torch's default budget, recorded."""
    flags, launcher = BACKENDS["single"]
    default = compiled("single", 0)  # inductor, torch's default budget, its last step profiled
    zero = train(tmp_path, "budget-0", *ARGS, *flags, "--compile", "--mem_profile_steps", "1",
                 "--compile_memory_budget", "0", launcher=launcher, timeout=900).check_ok()
    assert_losses_close(zero.losses, eager.losses[:STEPS], STEPS, RTOL)
    assert zero.config["backend"]["compile"]["activation_memory_budget"] == 0.0
    assert default.config["backend"]["compile"]["activation_memory_budget"] == 1.0
    kept = [run.summary["mem_breakdown"]["activation"] for run in (zero, default)]
    assert kept[0] < 0.5 * kept[1], kept
