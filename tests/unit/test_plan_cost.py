"""Each candidate priced (analysis/plan/cost.py): resolved as train.py resolves it, its peak against
the budget, its step time on a named GPU part by part, the ranking and the printed command."""

import json
import shlex
from pathlib import Path

import pytest
import yaml

from analysis import plan
from conftest import REPO
from conftest import dry_run

TINY = ["--preset", "tiny"]


def h100():
    return plan.named_device("H100-SXM", "infiniband-ndr", 0.4, 0.5, "fp32")


def _schedule(*flags: str) -> dict:
    from simulation.describe import resolve_flags

    setup = resolve_flags([*TINY, *flags], 2, 2)
    return setup.resolved.build(setup.env).comm_schedule(setup.workload.param_sizes)


def test_the_planner_on_a_named_gpu_and_the_projection_price_a_configuration_alike():
    """One tool's prediction of a run is the other's: analysis.plan on --gpu H100-SXM and analysis.project
    give each configuration the same compute, overlappable and waiting communication (the configuration's
    buckets and schedule: ZeRO-0's all-reduce after backward, ZeRO-2's gather in the optimizer step, DDP's
    last bucket),
    offload and step, on one node and on two."""
    from analysis.project import HARDWARE, Assumptions, project

    hw = yaml.safe_load(HARDWARE.read_text())
    gpu, net = hw["gpus"]["H100-SXM"], hw["networks"]["infiniband-ndr"]
    argv = ["--preset", "paper", "--precision", "bf16", "--attention", "sdpa"]
    device = plan.named_device("H100-SXM", "infiniband-ndr", 0.4, 0.5, "bf16")
    for world in (8, 16):
        for config in ("ddp", "ds_configs/z0.json", "ds_configs/z2.json", "ds_configs/z3.json",
                       "ds_configs/z2_offload.json", "fsdp_configs/full_shard.yaml"):
            row = plan.evaluate(plan.Candidate(config, 2, 1, "full/2"), argv, world, 8, 80.0, device)
            projected = project(config, [*argv, "--micro_batch", "2", "--grad_accum", "1", "--ckpt_interval", "2"],
                                world, gpu, net, hw["nvlink_latency_us"], Assumptions(mfu=0.4, overlap=0.5))
            for part in ("compute", "comm", "wait", "offload", "step"):
                assert row[f"{part}_ms"] == pytest.approx(projected[f"{part} ms"]), (config, world, part)
            assert (row["wait_ms"] > 0) == (config in ("ddp", "ds_configs/z0.json", "ds_configs/z2.json",
                                                       "ds_configs/z2_offload.json")), (config, world)


def test_a_candidate_over_the_budget_is_dropped_naming_what_breaks_it():
    """The same candidate fits a budget above its estimated peak (less the estimator's band) and not one
    below it, which names the part of the peak that breaks it; checkpointing lowers the peak."""
    cand = plan.Candidate("ddp", 8, 1, "none")
    roomy = plan.evaluate(cand, TINY, 2, 8, 10.0, h100())
    assert roomy["fits"] and "breaks" not in roomy and 0 < roomy["est_peak_gb"] < 10
    tight = plan.evaluate(cand, TINY, 2, 8, roomy["est_peak_gb"] * 1.1, h100())  # inside the 15% band
    assert not tight["fits"] and tight["breaks"].split()[0] in ("model", "activations", "other"), tight
    assert f"of {roomy['est_peak_gb']:.3g} GiB" in tight["breaks"]
    ckpt = plan.evaluate(plan.Candidate("ddp", 8, 1, "full/1"), TINY, 2, 8, 10.0, h100())
    assert ckpt["est_peak_gb"] < roomy["est_peak_gb"]


def test_on_a_named_gpu_selective_checkpointing_recomputes_only_what_it_does_not_keep():
    """A selective checkpoint keeps its matmuls' and attention's outputs (the run's default set), so on
    a named GPU its recompute is the rest of the forward, not the whole of it as full's is: priced as
    the whole (the selective set not resolved), it cost what full costs, where the H200 measured a
    third of full's cost (runs/reference/nvidia-h200/README.md)."""
    from backends.activation_checkpointing import SELECTIVE_SAVE_OPS
    from core.flops import sample_flops
    from simulation.describe import resolve_flags

    argv = [*TINY, "--attention", "sdpa"]
    rows = {ckpt: plan.evaluate(plan.Candidate("single", 8, 1, ckpt), argv, 1, 1, 10.0, h100())
            for ckpt in ("none", "selective/1", "full/1")}
    compute = {ckpt: row["compute_ms"] for ckpt, row in rows.items()}
    assert compute["none"] < compute["selective/1"] < compute["full/1"], compute
    workload = resolve_flags([*argv, "--micro_batch", "8"], world=1).workload
    full, selective = (sample_flops(workload, None, 1, kept) for kept in (None, SELECTIVE_SAVE_OPS))
    share = (compute["selective/1"] - compute["none"]) / (compute["full/1"] - compute["none"])
    assert share == pytest.approx(selective["recomputed"] / full["recomputed"])


def test_what_train_py_refuses_is_listed_with_its_reason():
    row = plan.evaluate(plan.Candidate("ds_configs/z3.json", 8, 1, "selective/1"), TINY, 2, 8, 10.0, h100())
    assert "refused" in row and "selective" in row["refused"], row


def test_recompute_and_communication_cost_time_on_a_named_gpu():
    """Full checkpointing of every block predicts a slower step than none (its recompute), and ZeRO-3
    more communication than DDP (gathers as well as reductions), the same compute."""
    none = plan.evaluate(plan.Candidate("ddp", 8, 1, "none"), TINY, 8, 8, 10.0, h100())
    full = plan.evaluate(plan.Candidate("ddp", 8, 1, "full/1"), TINY, 8, 8, 10.0, h100())
    z3 = plan.evaluate(plan.Candidate("ds_configs/z3.json", 8, 1, "none"), TINY, 8, 8, 10.0, h100())
    assert full["compute_ms"] > none["compute_ms"] and full["pred_samples_per_s"] < none["pred_samples_per_s"]
    assert z3["comm_ms"] > none["comm_ms"] and z3["compute_ms"] == pytest.approx(none["compute_ms"])


def test_the_ranking_puts_the_fastest_fitting_candidate_first():
    rows = plan.plan(TINY, 8, 8, 10.0, 64, h100(), ["ddp", "ds_configs/z3.json"], ("none", "full/1"), [8])
    fitting = [r for r in rows if r.get("fits")]
    assert fitting and rows[:len(fitting)] == fitting
    speeds = [r["pred_samples_per_s"] for r in fitting]
    assert speeds == sorted(speeds, reverse=True)
    peaks = sorted(r["est_peak_gb"] for r in fitting)
    budget = (peaks[0] + peaks[-1]) / 2
    tighter = plan.plan(TINY, 8, 8, budget, 64, h100(), ["ddp", "ds_configs/z3.json"], ("none", "full/1"), [8])
    fit = {r["command"] for r in tighter if r.get("fits")}
    assert fit == {r["command"] for r in fitting if r["est_peak_gb"] <= budget * (1 - plan.MARGIN)}
    assert 0 < len(fit) < len(fitting) and [r for r in tighter if r.get("fits")] == tighter[:len(fit)]


def test_the_pick_is_the_run_train_py_resolves_from_the_printed_command():
    """The command the planner prints, launched as train.py --dry_run as rank 0 of its world, resolves to
    the configuration the planner estimated (the same record, device aside)."""
    here = plan.Device("this machine", plan.Link(1.0, 100.0, "given"), plan.Link(1.0, 100.0, "given"),
                       micro_step_s=0.01, sample_s=0.001)  # as calibrated: the run on this machine's device
    row = plan.evaluate(plan.Candidate("fsdp_configs/shard_grad_op.yaml", 2, 2, "full/2"),
                        [*TINY, "--precision", "bf16"], 2, 2, 10.0, here)
    argv = shlex.split(row["command"])
    assert argv[:3] == ["torchrun", "--nproc_per_node", "2"] and argv[3] == "train.py"
    from simulation.describe import describe

    described, printed = describe(argv[4:], 2), dry_run(argv[4:], 2)
    described.pop("environment", None)
    printed.pop("environment", None)
    assert printed == described
    run = printed["run"]
    assert (run["micro_batch"], run["grad_accum"], run["ckpt_interval"], run["precision"]) == (2, 2, 2, "bf16")


def test_each_backend_says_how_its_collectives_run(tmp_path):
    """DeepSpeed: stage 0's fixed bucket after backward, stage 1-2 reductions by reduce_bucket_size
    (waiting without overlap_comm) and one gather in the optimizer step, ZeRO-3's forward gathers
    waiting without prefetch, ZeRO++'s int4 gradients (on a GPU: on a CPU they are not applied); FSDP's backward gathers without backward
    prefetch; DDP and FSDP2 say nothing (the projection's bucket, all overlappable)."""
    import math

    from analysis.project import comm_and_wait

    assert _schedule("--deepspeed_config", "ds_configs/z0.json") == {"all_reduce": (4 * 5e8, 1.0)}
    assert _schedule("--deepspeed_config", "ds_configs/z2.json") == {"reduce_scatter": (4 * 400000, 0.0),
                                                                    "all_reduce": (4 * 400000, 0.0),
                                                                    "all_gather": (math.inf, 1.0)}
    serial = json.loads((REPO / "ds_configs/z1.json").read_text())
    serial["zero_optimization"]["overlap_comm"] = False
    (tmp_path / "z1_serial.json").write_text(json.dumps(serial))
    schedule = _schedule("--deepspeed_config", str(tmp_path / "z1_serial.json"))
    assert schedule["reduce_scatter"] == schedule["all_reduce"] == (4 * 400000, 1.0)
    # --counted: DeepSpeed 0.19 reduces ZeRO-1/2's gradients by all-reduce; without overlap_comm it waits
    comm, wait = comm_and_wait({"all_reduce": (2, 1e6, 3)}, schedule, 8, (100.0, 1.0), (10.0, 5.0))
    assert comm == 0 < wait
    assert _schedule("--deepspeed_config", "ds_configs/z3.json") == {"reduce_scatter": (4 * 400000, 0.0),
                                                                    "all_gather": (None, 0.0)}
    varied = plan.write_variants(["ds_configs/z3.json", "fsdp_configs/full_shard.yaml"], str(tmp_path / "v"))
    by = {Path(v).name: v for v in varied}
    assert _schedule("--deepspeed_config", by["z3.no_prefetch.json"])["all_gather"] == (None, 0.5)
    assert _schedule("--deepspeed_config", "ds_configs/zeropp.json", "--device", "cuda")["reduce_scatter"] == (0.5 * 400000, 0.0)
    assert _schedule("--fsdp_config", "fsdp_configs/full_shard.yaml") == {"all_gather": (None, 0.0)}
    assert _schedule("--fsdp_config", by["full_shard.no_backward_prefetch.yaml"]) == {"all_gather": (None, 0.5)}
    assert _schedule("--fsdp_config", "fsdp_configs/fsdp2.yaml") == {}
    # DDP: its buckets, a call each; the last waits (the tiny preset's 846848 gradient bytes: all in DDP's
    # own 1 MiB first bucket; at 0.1 MiB, 7 buckets, each closed at 0.1 MiB or more, the last 49920 bytes)
    assert _schedule("--backend", "ddp") == {"all_reduce": (846848, 1.0)}
    assert _schedule("--backend", "ddp", "--ddp_bucket_cap_mb", "0.1") == {
        "all_reduce": (pytest.approx(846848 / 7), pytest.approx(49920 / 846848))}


def test_a_frozen_fsdp_unit_is_priced_without_its_reduce_scatter():
    """An FSDP unit whose parameters are all frozen makes its two gathers and no reduce-scatter: two
    thirds of a unit that trains (backend_costs.items). frozen_tied's first block is frozen, its
    second and its root (the tied embedding) train; unfreezing the block prices it a whole unit."""
    import torch

    from analysis.plan import backend_costs as bc
    from simulation.describe import resolve_flags

    flags = ["--model", str(REPO / "benchmarks/zoo/frozen_tied.py"), "--fsdp_config", "fsdp_configs/fsdp2.yaml"]
    setup = resolve_flags(flags, 2)
    assert bc.items(setup, "fsdp2") == ("FSDP unit", pytest.approx(2 + bc.FROZEN_UNIT))
    from core.blocks import find_blocks

    model = setup.workload.meta()
    blocks = find_blocks(model)
    assert bc.frozen_units(model, None) == (3, 1)
    blocks[0].requires_grad_(True)
    assert bc.frozen_units(model, None) == (3, 0)
    model.requires_grad_(False)  # nothing trains: the root and both blocks frozen
    assert bc.frozen_units(model, None) == (3, 3)
    # a root that holds nothing but its blocks counts as a unit that trains
    bare = torch.nn.Sequential(torch.nn.ModuleList(blocks))
    bare.requires_grad_(True)
    assert bc.frozen_units(bare, None) == (3, 0)


def test_a_configurations_measured_cost_is_added_to_its_step_and_left_out_of_the_refit():
    """A device with a configuration's measured cost prices that configuration's candidates its cost
    (per step + accumulation x (per micro-step + per item x the model's items: FSDP's units, the blocks
    and the root, else trainable tensors)) on top of the same step without, and no other
    configuration's; the refit takes it as given."""
    from analysis.plan import backend_costs as bc
    from simulation.describe import resolve_flags

    link = plan.Link(1.0, 100.0, "test")
    costs = {"per_step_s": 0.01, "per_micro_step_s": 0.003, "per_item_s": 2e-5, "per_param_s": 1e-8,
             "item": "FSDP unit"}
    bare = plan.Device("test", link, link, sample_s=1e-3, micro_step_s=1e-3, optimizer_s=1e-3)
    priced = plan.Device("test", link, link, sample_s=1e-3, micro_step_s=1e-3, optimizer_s=1e-3,
                         backend_costs={"fsdp_configs/fsdp2.yaml": costs})
    units = bc.items(resolve_flags([*TINY, "--fsdp_config", "fsdp_configs/fsdp2.yaml"], 2), "fsdp2")
    assert units == ("FSDP unit", 4 + 1)  # the tiny preset's 4 blocks and the root
    kind, tensors = bc.items(resolve_flags([*TINY, "--backend", "ddp"], 2), "ddp")
    # per block two LayerNorms (4), q k v without bias (3), proj (2), the MLP's two Linears (4); two
    # embeddings, the last LayerNorm (2) and the head without bias
    assert kind == "trainable tensor" and tensors == 4 * 13 + 5
    params = bc.trainable_params(resolve_flags([*TINY, "--backend", "ddp"], 2))
    assert params == resolve_flags([*TINY, "--backend", "ddp"], 2).n_params > 0
    for config, accum in (("fsdp_configs/fsdp2.yaml", 2), ("fsdp_configs/fsdp2.yaml", 1), ("ddp", 2)):
        cand = plan.Candidate(config, 8 // accum, accum, "none")
        a, b = (plan.evaluate(cand, TINY, 2, 2, 1.0, d) for d in (bare, priced))
        own = bc.cost_seconds(costs, accum, units[1], params) if config != "ddp" else 0.0
        assert b["own_ms"] == pytest.approx(own * 1e3) and b["step_ms"] == pytest.approx(a["step_ms"] + own * 1e3)
    rows = [plan.evaluate(plan.Candidate(c, m, 8 // m, "none"), TINY, 2, 2, 1.0, priced)
            for c in ("fsdp_configs/fsdp2.yaml", "ddp") for m in (4, 8)]
    verified = [{"command": r["command"], "status": "ok", "measured_samples_per_s": 16 / (
        (2 * r["compute_ms"] + 0.4 * r["comm_ms"] + r["wait_ms"] + r["own_ms"]) / 1e3)} for r in rows]
    fitted = plan.refit(rows, verified, 16)  # measured: twice the compute, the own cost as measured
    assert fitted["compute_factor"] == pytest.approx(2, rel=1e-6) and fitted["overlap"] == pytest.approx(0.6)
    assert fitted["overhead"] == {"fsdp_configs/fsdp2.yaml": pytest.approx(1), "ddp": pytest.approx(1)}
