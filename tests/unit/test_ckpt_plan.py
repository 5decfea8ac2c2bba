"""Checkpointing by memory budget (estimator/checkpointing_plan.py): the solver against brute force, and the
plans of GPT-lite and an HF Llama-style model against the hand-set policies, on the estimator."""

import itertools
import math
import random

import pytest

from estimator import checkpointing_plan as ckpt_plan
from estimator.estimate import estimate
from backends.activation_checkpointing import save_ops_for
from conftest import TRAIN, dry_run, python
from core.flops import block_flops_by_op

GiB = 2**30


def _brute_force(room, kept, cost):
    best = None
    for plan in itertools.product(*(list(k) for k in kept)):
        prefix = [sum(kept[i][c] for i, c in enumerate(plan[:k])) for k in range(len(plan) + 1)]
        if all(p <= r for p, r in zip(prefix, room)):
            total = tuple(sum(cost[i][c][j] for i, c in enumerate(plan)) for j in range(2))
            best = total if best is None or total < best else best
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_solver_finds_the_least_cost_plan_brute_force_finds(seed):
    """Random blocks (kept bytes and costs per choice, ties included) and random prefix limits: the
    solver's plan is feasible and costs what the cheapest feasible plan costs, or both find none."""
    rng = random.Random(seed)
    blocks = rng.randint(1, 6)
    kept, cost = [], []
    for _ in range(blocks):
        full = rng.randint(1, 4)
        selective = full + rng.randint(0, 6)
        kept.append({"none": selective + rng.randint(0, 6), "selective": selective, "full": full})
        flops = rng.choice([0, 1, 2, 5])
        cost.append({"none": (0, 0), "selective": (flops, rng.randint(1, 5)), "full": (flops + rng.randint(0, 8), 9)})
    total = sum(k["none"] for k in kept)
    room = [rng.choice([float("inf"), rng.randint(0, total)]) for _ in range(blocks + 1)]
    plan = ckpt_plan.solve(room, kept, cost)
    best = _brute_force(room, kept, cost)
    if best is None:
        assert plan is None
        return
    assert plan is not None, f"no plan found, brute force found one costing {best}"
    prefix = [sum(kept[i][c] for i, c in enumerate(plan[:k])) for k in range(blocks + 1)]
    assert all(p <= r for p, r in zip(prefix, room)), (plan, prefix, room)
    assert tuple(sum(cost[i][c][j] for i, c in enumerate(plan)) for j in range(2)) == best


def _models():
    import models
    from estimator.traced_model import _gptlite_workload
    from estimator.traced_model import TracedModel
    from core.config import RunConfig

    gpt = RunConfig(preset="small").model_config(vocab_size=65)
    llama = RunConfig(model="hf:llama", model_args="num_hidden_layers=6,hidden_size=192,num_attention_heads=6,"
                      "num_key_value_heads=6,intermediate_size=512")
    workload = models.load(llama.model_request())
    return {"gptlite": (gpt, _gptlite_workload(gpt)), "llama": (TracedModel.of(workload), workload)}


@pytest.fixture(scope="module")
def planned_models():
    return _models()


@pytest.mark.parametrize("model", ["gptlite", "llama"])
@pytest.mark.parametrize("backend, options", [("single", None), ("deepspeed", {"zero_optimization": {"stage": 2}})])
def test_plans_fit_their_budgets_fall_with_them_and_beat_the_hand_set_policies(planned_models, model, backend, options):
    """Five budgets between full checkpointing's peak and no checkpointing's: each plan's estimated peak
    is within its budget less the headroom, peaks fall as budgets fall while the recompute grows, and no hand-set policy
    (every k-th block full or selective) that fits a budget recomputes fewer FLOPs than its plan."""
    cfg, workload = planned_models[model]
    world = 1 if backend == "single" else 2

    def est(**kw):
        return estimate(cfg, backend, world, 8, "fp32", device="cpu", ds_config=options, **kw)

    flops = block_flops_by_op(workload, None)
    blocks = len(flops)
    kept_by_selective = set(save_ops_for("selective", None))
    lowest, highest = est(ckpt_interval=1).total_bytes, est().total_bytes
    assert lowest < highest
    base = est(ckpt_interval=1, ckpt_policy="selective")
    hand_set = {f"{p} every {k}": [p if i % k == 0 else "none" for i in range(blocks)]
                for p in ("full", "selective") for k in (1, 2, 3)}
    peaks, costs = [], []
    for step in range(5):
        budget = (lowest + (highest - lowest) * (4 - step) / 4) / GiB / (1 - ckpt_plan.HEADROOM)
        chosen = ckpt_plan.plan(base, budget, flops)
        assert chosen.peak_bytes <= budget * GiB * (1 - ckpt_plan.HEADROOM)
        assert est(ckpt_plan=chosen.choices).total_bytes == chosen.peak_bytes
        for name, choices in hand_set.items():
            if est(ckpt_plan=choices).total_bytes <= budget * GiB * (1 - ckpt_plan.HEADROOM):
                recomputed = sum(f for block, c in zip(flops, choices) if c != "none"
                                 for op, f in block.items() if c == "full" or op not in kept_by_selective)
                assert chosen.cost[0] <= recomputed, f"{name} fits {budget:.3f} GiB recomputing less than {chosen}"
        peaks.append(chosen.peak_bytes)
        costs.append(chosen.cost)
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1], peaks
    assert costs == sorted(costs), costs
    # A budget of no checkpointing's peak (a byte over it: GiB and the headroom there and back in floats
    # may lose the last byte) plans no checkpointing.
    assert ckpt_plan.plan(base, (highest + 1) / GiB / (1 - ckpt_plan.HEADROOM), flops).choices == ["none"] * blocks


@pytest.mark.parametrize("backend", ["fsdp", "fsdp2"])
def test_fsdp_on_gloo_is_planned_below_its_budget_by_a_reduce_scatter_in_flight(planned_models, backend):
    """On CPU an FSDP reduce-scatter may still be in flight on gloo's thread at the peak (its input and
    gloo's copy: two of the largest unit's gradient), a time the program's order does not fix: a plan
    leaves that room, so a budget at no checkpointing's estimate does not plan no checkpointing there,
    as it does where nothing is in flight (DDP); and the smallest budget named counts it."""
    cfg, workload = planned_models["gptlite"]
    flops = block_flops_by_op(workload, None)
    unit = 4 * sum(p.numel() for p in cfg_block_params(cfg))

    def base(name):
        return estimate(cfg, name, 2, 8, "fp32", device="cpu", ckpt_interval=1, ckpt_policy="selective")

    fsdp, ddp = base(backend), base("ddp")
    assert fsdp.unfixed_bytes == 2 * unit and ddp.unfixed_bytes == 0
    for est, planned_none in ((fsdp, False), (ddp, True)):
        none = ckpt_plan.peak_of(est, [est.activations.full[i] for i in range(len(flops))])
        choices = ckpt_plan.plan(est, none / GiB / (1 - ckpt_plan.HEADROOM), flops).choices
        assert (choices == ["none"] * len(flops)) == planned_none, choices
    lowest = ckpt_plan.peak_of(fsdp, [fsdp.activations.kept[i] for i in range(len(flops))])
    named = math.ceil((lowest + 2 * unit) / (1 - ckpt_plan.HEADROOM) / GiB * 1000) / 1000
    with pytest.raises(ckpt_plan.ConfigError, match=f"smallest budget a plan fits is {named:.3f} GiB"):
        ckpt_plan.plan(fsdp, (lowest + unit) / GiB, flops)


def cfg_block_params(cfg):
    from gptlite.model import meta_model

    return list(meta_model(cfg).blocks[0].parameters())


def test_the_cli_prints_a_plan_or_names_the_smallest_reachable_peak():
    from analysis.estimate_cli import main
    from conftest import in_process

    def cli(*args):
        # Counted: a measured cost (the default) times this machine, and may weigh selective as full. In this
        # process (tests/unit/test_trust.py runs the estimator's refusals as processes).
        return in_process(main, ["--preset", "small", "--micro_batch", "8", "--device", "cpu", "--ckpt_cost",
                                 "counted", *args])

    fits = cli("--ckpt_policy", "auto", "--mem_budget_gb", "0.15")
    assert fits.returncode == 0, fits.stderr
    assert "checkpointing planned for 0.15 GiB: " in fits.stdout and "selective" in fits.stdout
    # Under ZeRO-3 the plan holds none and full, as train.py's (selective is refused there).
    zero3 = cli("--deepspeed_config", "ds_configs/z3.json", "--world", "2", "--ckpt_policy", "auto", "--mem_budget_gb", "0.2")
    assert zero3.returncode == 0 and "full" in zero3.stdout and "selective" not in zero3.stdout, zero3.stdout
    too_small = cli("--ckpt_policy", "auto", "--mem_budget_gb", "0.01")
    assert too_small.returncode == 2 and too_small.stdout == ""
    line = too_small.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and "smallest budget a plan fits is" in line, line
    least = float(line.split("smallest budget a plan fits is ")[1].split()[0])
    assert cli("--ckpt_policy", "auto", "--mem_budget_gb", str(least)).returncode == 0
    for args, words in ((("--ckpt_policy", "auto"), "needs --mem_budget_gb"),
                        (("--ckpt_policy", "auto", "--mem_budget_gb", "1", "--ckpt_interval", "2"), "drop --ckpt_interval"),
                        (("--ckpt_policy", "auto", "--mem_budget_gb", "-1"), "mem_budget_gb must be > 0")):
        bad = cli(*args)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, (args, bad.stderr)


def _budget_between(config: dict, world: int) -> float:
    """A budget halfway between full checkpointing's estimated peak and no checkpointing's, in GiB."""
    from estimator.estimate import record_arguments

    model, args, kwargs = record_arguments({**config, "world_size": world})
    peaks = [estimate(model, *args[:4], interval, *args[5:], **kwargs).total_bytes for interval in (0, 1)]
    return round((peaks[0] + peaks[1]) / 2 / GiB, 4)


@pytest.mark.parametrize("launcher, backend", [
    pytest.param("python", (), marks=pytest.mark.launch),
    pytest.param("deepspeed", ("--deepspeed_config", "ds_configs/z3.json"), marks=pytest.mark.distributed)],
    ids=["single", "zero3"])
def test_an_auto_run_trains_as_without_checkpointing_within_its_budget(tmp_path, launcher, backend):
    """train.py --ckpt_policy auto: the plan printed before training and recorded per block; the losses
    of the same run without checkpointing (dropout 0.1: the recomputed masks are the forward's); a
    measured peak within the budget. Under ZeRO-3 the plan holds none and full only."""
    import json

    from conftest import assert_losses_close, train

    common = ("--preset", "small", "--micro_batch", "8", "--steps", "3", "--dropout", "0.1", "--precision", "fp32",
              "--warmup_steps", "0", "--eval_batches", "1", "--lr_warmup_steps", "0", *backend)
    world = 1 if launcher == "python" else 2

    budget = _budget_between(dry_run(list(common), 1), world)
    plain = train(tmp_path, "plain", *common, launcher=launcher).check_ok()
    # One process plans on counted costs (what this test holds does not depend on them, and timing
    # the model doubles the run); ZeRO-3's two ranks on the default, measured ones: rank 0 times the
    # model and every rank runs its plan (Run.agree_on_plan), end to end.
    cost = ("--ckpt_cost", "counted") if launcher == "python" else ()
    auto = train(tmp_path, "auto", *common, "--ckpt_policy", "auto", "--mem_budget_gb", str(budget), *cost,
                 launcher=launcher).check_ok()
    assert_losses_close(auto.losses, plain.losses, 3, rtol=1e-6)
    plan = auto.config["run"]["ckpt_plan"].split(",")
    assert auto.config["backend"]["activation_checkpointing"]["plan"] == plan and len(plan) == 6
    assert "none" in plan and set(plan) - {"none"}, f"a budget between the extremes needs a mixed plan: {plan}"
    if launcher == "deepspeed":
        assert "selective" not in plan
    assert auto.summary["mem_peak_bytes"] <= budget * GiB < plain.summary["mem_peak_bytes"]
    # The plan is said before training starts (train.py without --quiet prints it first).
    shown = python(TRAIN, *common, "--ckpt_policy", "auto", "--mem_budget_gb", budget, "--ckpt_cost", "counted",
                   "--steps", "1", "--runs_dir", tmp_path / "shown", timeout=300) if launcher == "python" else None
    if shown is not None:
        assert shown.returncode == 0, shown.stderr
        first = shown.stdout.splitlines()[0]
        assert first.startswith(f"ckpt_policy auto, mem_budget_gb {budget:g}: ") and "estimated peak" in first, first


@pytest.mark.launch
def test_a_resumed_auto_run_keeps_the_plan_it_started_with(tmp_path):
    """Resumed at another micro-batch (the same global batch), for which auto would plan otherwise, the
    run continues with its recorded plan rather than being refused as a run with other settings."""
    from conftest import train

    common = ("--preset", "small", "--dropout", "0", "--precision", "fp32", "--warmup_steps", "0", "--eval_batches",
              "1", "--ckpt_policy", "auto", "--mem_budget_gb", "0.15", "--ckpt_cost", "counted",
              "--save_dir", str(tmp_path / "ckpt"),
              "--save_every", "1")
    first = train(tmp_path / "runs", "r", *common, "--steps", "2", "--micro_batch", "8").check_ok()
    plan = first.config["run"]["ckpt_plan"]

    dry = dry_run(["--preset", "small", "--micro_batch", "4", "--ckpt_policy", "auto", "--mem_budget_gb", "0.15",
                   "--ckpt_cost", "counted"], 1)
    assert dry["run"]["ckpt_plan"] != plan, "the test needs a micro-batch planned otherwise"
    resumed = train(tmp_path / "runs", "r", *common, "--steps", "3", "--micro_batch", "4", "--grad_accum", "2",
                    "--resume").check_ok()
    assert resumed.config["run"]["ckpt_plan"] == plan and len(resumed.losses) == 3


def json_plan(text: str) -> str:
    import json

    return json.loads(text)["run"]["ckpt_plan"]


def test_a_measured_cost_decides_between_selective_and_full(planned_models):
    """With a measured cost, the plan weighs seconds, not FLOPs: where selective measures dearer than full,
    no block is planned selective (full keeps less and costs less); where it measures cheap, the same
    budget plans selective blocks. Counted (no measurement), GPT-lite's naive attention makes selective
    the cheaper by far."""
    cfg, workload = planned_models["gptlite"]
    flops = block_flops_by_op(workload, None)
    base = estimate(cfg, "single", 1, 8, "fp32", device="cpu", ckpt_interval=1, ckpt_policy="selective")
    lowest, highest = (estimate(cfg, "single", 1, 8, "fp32", device="cpu", ckpt_interval=k).total_bytes for k in (1, 0))
    budget = (lowest + highest) / 2 / GiB
    counted = ckpt_plan.plan(base, budget, flops)
    dear = ckpt_plan.plan(base, budget, flops, measured={"full": 0.01, "selective": 0.02})
    cheap = ckpt_plan.plan(base, budget, flops, measured={"full": 0.01, "selective": 0.001})
    assert "selective" in counted.choices and "selective" in cheap.choices
    assert "selective" not in dear.choices and "full" in dear.choices
    assert dear.measured and not counted.measured and dear.peak_bytes <= budget * GiB


def test_the_recompute_is_timed_on_the_real_model(monkeypatch):
    """measured_costs builds the model and times a micro-batch with every block checkpointed: full
    recomputes every block's forward, so it costs more than none; nothing is measured where the model's
    step would not fit in half the device's free memory. Its clock here counts the FLOPs a timed call runs
    (deterministic where seconds are not: no wall clock in a test)."""
    from torch.utils.flop_counter import FlopCounterMode

    import models
    from core.config import RunConfig

    def clock(dev, fn):
        with FlopCounterMode(display=False) as counted:
            fn()
        return float(counted.get_total_flops())

    monkeypatch.setattr(ckpt_plan, "seconds_of", clock)
    workload = models.load(RunConfig(preset="tiny").model_request())
    costs = ckpt_plan.measured_costs(workload, None, 4, "cpu", None, ["full", "selective"], 2**20)
    assert set(costs) == {"full", "selective"} and costs["full"] > 0 and costs["full"] >= costs["selective"] >= 0
    assert ckpt_plan.measured_costs(workload, None, 4, "cpu", None, ["full"], 2**60) is None


def test_the_timed_step_runs_in_the_runs_precision():
    """The recompute and the planner's calibration time a micro-batch as the torch backends run it: under
    autocast to bf16 for a bf16 run (its matrix products in bf16), in fp32 for an fp32 run. Timed in fp32,
    a bf16 run's step on a GPU would be several times too slow."""
    import torch

    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            out = self.proj(x)
            seen.append(out.dtype)
            return out, (out.float() - y).pow(2).mean()

    model = Probe()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    ckpt_plan.forward_backward(model, x, y, "bf16")
    ckpt_plan.forward_backward(model, x, y, "fp32")
    assert seen == [torch.bfloat16, torch.float32]
    assert model.proj.weight.grad is not None and model.proj.weight.grad.dtype == torch.float32


def _agree(rank: int, port: int, plans: list, out) -> None:
    import dataclasses

    import torch.distributed as dist

    from core.config import RunConfig
    from training.lifecycle import Run

    @dataclasses.dataclass
    class Resolved:
        cfg: RunConfig

    class Setup:
        def __init__(self, cfg):
            self.resolved = Resolved(cfg)

        @property
        def cfg(self):
            return self.resolved.cfg

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    run = Run.__new__(Run)
    run.s = Setup(RunConfig(ckpt_policy="auto", mem_budget_gb=1.0, ckpt_plan=plans[rank]))
    run.cfg = run.s.cfg
    run.agree_on_plan()
    out.put((rank, run.cfg.ckpt_plan, run.s.cfg.ckpt_plan))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_every_rank_runs_rank_0s_plan():
    """Rank 1 planned otherwise (a measured cost is rank 0's alone): once the process group exists it
    takes rank 0's plan (two real processes on gloo)."""
    import multiprocessing as mp

    from core.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    plans = ["full,full,none", "selective,none,none"]
    procs = [ctx.Process(target=_agree, args=(r, port, plans, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == [(0, plans[0], plans[0]), (1, plans[0], plans[0])]


def test_ctrl_c_while_an_auto_run_plans_is_one_line_and_records_nothing(tmp_path):
    """Ctrl-C during --ckpt_policy auto's cost measurement printed a KeyboardInterrupt traceback (issue 39,
    case 13): one line, exit 130, no record."""
    import train
    from conftest import in_process
    from training.cli import build_parser, parse_args
    from training.run import main

    def interrupted(*args, **kwargs):  # the planner, as Ctrl-C reaches it measuring the blocks' recompute
        raise KeyboardInterrupt

    parser = build_parser(description=train.DESCRIPTION, examples=train.EXAMPLES)
    proc = in_process(lambda a: main(parse_args(a, parser=parser), planner=interrupted),
                      ["--preset", "tiny", "--steps", "2", "--ckpt_policy", "auto", "--mem_budget_gb", "1",
                       "--runs_dir", tmp_path / "runs", "--run_name", "r"])
    assert proc.returncode == 130 and "interrupted (Ctrl-C) before training" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
