"""The planner (analysis/plan/): the candidates it searches, the budget that prunes them, the ranking,
the commands it prints (which train.py resolves as the planner did), this machine's calibration, the
CLI's bad input, and --verify's real runs through the sweep runner."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from analysis import plan
from conftest import REPO, base_env
from gptlite.errors import ConfigError
from test_describe import dry_run

TINY = ["--preset", "tiny"]


def h100():
    return plan.named_device("H100-SXM", "infiniband-ndr", 0.4, 0.5, "fp32")


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


@pytest.mark.distributed  # fake-process-group runs, one process each (as tests/test_fake_world.py)
def test_counted_candidates_are_priced_by_the_calls_their_runs_make(tmp_path, monkeypatch, forked_launchers):
    """--counted: each fitting candidate run as rank 0 of W under the fake process group, once per
    configuration, accumulation and checkpointing; ZeRO-3 gathers module by module, so its counted
    calls are many times the theory's 25 MiB buckets, without prefetch the forward's half of them
    waits, and with more parameters persistent fewer bytes are gathered; the price is analysis.project's for the same count. A count that fails leaves its
    candidates on the theory, saying why."""
    from analysis import project as projection

    varied = plan.write_variants(["ds_configs/z3.json"], str(tmp_path))
    configs = ["ds_configs/z3.json", *varied]
    args = (TINY, 2, 2, 10.0, 8, h100(), configs, ("none",), [2, 4])
    calls = []
    real = projection.count_flags
    monkeypatch.setattr(projection, "count_flags", lambda *a: calls.append(a[0]) or real(*a))
    counted = {(Path(r["config"]).name, r["micro x accum"]): r for r in plan.plan(*args, bases=varied, counted=True)}
    theory = {(Path(r["config"]).name, r["micro x accum"]): r for r in plan.plan(*args, bases=varied)}
    assert len(calls) == 6  # three configurations x two accumulations, checkpointing none
    assert all(r["bytes"] == "counted" for r in counted.values()) and all(r["bytes"] == "theory" for r in theory.values())
    z3, bare = counted[("z3.json", "2x2")], counted[("z3.no_prefetch.json", "2x2")]
    assert z3["calls"] > 10 * theory[("z3.json", "2x2")]["calls"]
    assert z3["wait_ms"] == 0 < bare["wait_ms"]
    kept = counted[("z3.persistence_x100.json", "2x2")]  # the small ones are not gathered
    assert kept["comm_bus_bytes"] < z3["comm_bus_bytes"]
    assert theory[("z3.persistence_x100.json", "2x2")]["comm_bus_bytes"] == theory[("z3.json", "2x2")]["comm_bus_bytes"]
    assert (z3["step_ms"] - bare["step_ms"]) < (theory[("z3.json", "2x2")]["step_ms"]
                                                - theory[("z3.no_prefetch.json", "2x2")]["step_ms"]) < 0
    count = real([*TINY, *z3["candidate"].flags()], 2, 2, "z3")
    hw = yaml.safe_load(projection.HARDWARE.read_text())
    projected = projection.project("ds_configs/z3.json", [*TINY, "--micro_batch", "2", "--grad_accum", "2"], 2,
                                   hw["gpus"]["H100-SXM"], hw["networks"]["infiniband-ndr"], hw["nvlink_latency_us"],
                                   projection.Assumptions(mfu=0.4, overlap=0.5), count)
    for part in ("comm", "wait", "step"):
        assert z3[f"{part}_ms"] == pytest.approx(projected[f"{part} ms"]), part

    def fails(*a):
        raise RuntimeError("z3 at 2 ranks under the fake process group failed: no")

    monkeypatch.setattr(projection, "count_flags", fails)
    rows = plan.plan(TINY, 2, 2, 10.0, 8, h100(), ["ds_configs/z3.json"], ("none",), [4], counted=True)
    assert rows[0]["bytes"] == "theory (z3 at 2 ranks under the fake process group failed: no)"
    assert rows[0]["step_ms"] == pytest.approx(theory[("z3.json", "4x1")]["step_ms"])


def test_candidates_cover_every_micro_batch_times_accumulation_that_makes_the_global_batch():
    cands = plan.candidates(["ddp", "ds_configs/z3.json"], 2, 16, ("none", "full/1"))
    assert {(c.micro_batch, c.grad_accum) for c in cands} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert all(c.micro_batch * c.grad_accum * 2 == 16 for c in cands)
    assert len(cands) == 2 * 4 * 2 and len(set(cands)) == len(cands)
    assert {(c.micro_batch, c.grad_accum) for c in plan.candidates(["ddp"], 2, 16, ("none",), [2, 3])} == {(2, 4)}
    with pytest.raises(ConfigError, match="global_batch 15 must be a multiple of world 2"):
        plan.candidates(["ddp"], 2, 15)
    with pytest.raises(ConfigError, match="none divides"):
        plan.candidates(["ddp"], 2, 16, ("none",), [3])
    with pytest.raises(ConfigError, match="ckpt 'full/0'"):
        plan.Candidate("ddp", 1, 1, "full/0")


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


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "analysis.plan", *args], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=300)


def _here(*args):
    """analysis.plan's main in this process: the logic (the CLI as a process: the test below)."""
    from conftest import in_process

    return in_process(plan.main, args)


@pytest.mark.launch
def test_the_cli_answers_in_json_for_a_named_gpu():
    proc = _cli("--world", "8", "--gpu", "H100-SXM", "--mem_budget_gb", "10", "--global_batch", "64",
                "--configs", "ddp", "ds_configs/z3.json", "--ckpt", "none", "full/1", "--micro_batches", "8", "--json",
                *TINY)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["candidates"]) == 4 and out["pick"] == out["candidates"][0]["command"]
    assert all({"command", "est_peak_gb", "pred_samples_per_s", "fits"} <= set(c) for c in out["candidates"])


def test_out_writes_the_plan_and_its_figure(tmp_path):
    """--out DIR: plan.md with the ranked table and the pick (the command train.py would run), and
    plan.png; the JSON on stdout is unchanged by it."""
    out = tmp_path / "plan"
    proc = _here("--world", "8", "--gpu", "H100-SXM", "--mem_budget_gb", "0.008", "--global_batch", "64",
                "--configs", "ddp", "ds_configs/z3.json", "--ckpt", "none", "full/1", "--json", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    text = (out / "plan.md").read_text()
    assert answer["pick"] in text and "over the budget" in text
    fitting = [c for c in answer["candidates"] if c["fits"]]
    assert 0 < len(fitting) < len(answer["candidates"])  # the figure has both kinds to show
    assert f"{len(answer['candidates'])} candidates" in text and f"{len(fitting)} fit" in text
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_frontier_keeps_what_nothing_beats_on_both_memory_and_speed():
    points = [(1.0, 10.0), (2.0, 5.0), (3.0, 20.0), (0.5, 1.0), (3.0, 15.0), (4.0, 20.0)]
    assert plan.frontier(points) == [(0.5, 1.0), (1.0, 10.0), (3.0, 20.0)]


@pytest.mark.parametrize("args, message", [
    pytest.param(["--out", "/proc/version"], "--out: /proc/version exists and is not a directory",
                 marks=pytest.mark.launch),  # as a process: its exit code and its one line
    (["--micro_batch", "4"], "--micro_batch: the planner chooses it"),
    (["--deepspeed_config", "ds_configs/z3.json"], "--deepspeed_config: the planner chooses it"),
    (["--ddp_bucket_cap_mb", "50"], "--ddp_bucket_cap_mb: the planner chooses it"),
    (["--configs", "ds_configs/nope.json"], "--configs ds_configs/nope.json: must be"),
    (["--ckpt", "every/2"], "ckpt 'every/2'"),
    (["--global_batch", "15"], "global_batch 15 must be a multiple of world 2"),
    (["--variants", "/proc/version", "--configs", "ds_configs/z3.json"], "--variants: /proc/version exists and is not a"),
    # Issue 39 (cases 5, 10, 12): each refused before any calibration (--gpu here would calibrate next).
    (["--mem_budget_gb", "nan", "--gpu", "here"], "--mem_budget_gb must be a number of GiB > 0 (got nan)"),
    (["--mem_budget_gb", "inf", "--gpu", "here"], "--mem_budget_gb must be a number of GiB > 0 (got inf)"),
    (["--gpus_per_node", "-1"], "--gpus_per_node must be >= 1"),
    (["--configs", "accelerate_configs/cpu_2proc.yaml"], "--configs accelerate_configs/cpu_2proc.yaml: not an FSDP"),
    (["--ckpt", "none", "none"], "--ckpt: each at most once (none is given 2 times)"),
    (["--configs", "ddp", "ddp"], "--configs: each at most once"),
    (["--ckpt", "none", "full/99", "--gpu", "here"], "--ckpt full/99: K must be at most the model's 4 blocks"),
    (["--gpu", "here", "--race", "--race_within", "1.5"], "--race_within must lie between 0 and 1 (got 1.5)"),
    (["--gpu", "here", "--race", "--race_within", "nan"], "--race_within must lie between 0 and 1 (got nan)"),
    (["--top", "0"], "--top must be >= 1"),
    (["--top", "-1"], "--top must be >= 1"),
    (["--gpu", "here", "--verify", "1", "--timeout_s", "0"], "--timeout_s must be a number of seconds > 0"),
    (["--save_dir", "/tmp/ck", "--gpu", "here"], "--save_dir: one run's own"),
    (["--run_name", "mine"], "--run_name: one run's own"),
    # a question every candidate is refused for, for one reason: that reason, not an empty table
    (["--world", "4", "--gpus_per_node", "3", "--json"], "gpus_per_node 3 must divide world 4"),
    # where the verifying runs go, checked before the calibration (it failed after, in a traceback)
    (["--gpu", "here", "--verify", "1", "--runs_dir", "/proc/gptlite-plan"],
     "--runs_dir: /proc/gptlite-plan is not writable"),
    (["--gpu", "here", "--race", "--runs_dir", "/proc/gptlite-plan"], "--runs_dir: /proc/gptlite-plan is not writable"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    base = {"--world": "2", "--gpu": "H100-SXM", "--mem_budget_gb": "1", "--global_batch": "16"}
    for flag in [a for a in args if a in base]:
        base.pop(flag)
    run = _cli if "/proc/version" in args and "--out" in args else _here
    proc = run(*[x for kv in base.items() for x in kv], *args, *TINY)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.launch
def test_ctrl_c_is_one_line_exit_130_and_writes_nothing(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the plan's whole process group) once the plan says it is
    calibrating: one line, exit code 130, no traceback (from the plan or from a process it started),
    no --out written. 130 is 128 + SIGINT, what a shell reports for a command Ctrl-C stopped and what
    sweep.py returns; 2 would say bad input."""
    import signal

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "analysis.plan", "--world", "2", "--gpu", "here", "--mem_budget_gb",
                             "1", "--global_batch", "16", "--out", str(out), *TINY], cwd=REPO, env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # as from a terminal: a shell's background job (`make test &`) starts with SIGINT
                            # ignored, which the plan would rightly inherit
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    before = []  # what it said before its progress line
    while not (before and before[-1].startswith("calibrating this machine")):
        before.append(proc.stderr.readline())
        assert before[-1], "".join(before)  # it ended without saying it calibrates
    os.killpg(proc.pid, signal.SIGINT)
    stdout, rest = proc.communicate(timeout=300)  # until every process holding its stderr has ended
    assert proc.returncode == 130, rest
    lines = rest.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m analysis.plan: stopped (Ctrl-C)"), rest
    assert "Traceback" not in "".join(before) + stdout + rest and stdout == ""
    assert not out.exists()


@pytest.mark.launch  # a process started
def test_the_calibrations_processes_ignore_ctrl_c_and_stop_with_the_plan():
    """The plan's own processes (the calibration's, the link probe's) start with SIGINT ignored, so a
    Ctrl-C to the terminal's group reaches the plan alone, which stops them as it leaves."""
    import multiprocessing
    import signal

    from analysis.plan.device import started

    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,))
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with started([proc]):
            python = os.path.realpath(sys.executable)
            for _ in range(600):  # started through a shell script: until it has become Python
                if os.path.realpath(f"/proc/{proc.pid}/exe") == python:
                    break
                time.sleep(0.05)
            status = Path(f"/proc/{proc.pid}/status").read_text()
            ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
            assert ignored & (1 << (signal.SIGINT - 1))  # inherited through exec: ignored from its first instruction
            assert signal.getsignal(signal.SIGINT) == handler  # this process's own handler stayed
            raise KeyboardInterrupt
    assert proc.exitcode == -signal.SIGTERM  # stopped, not left running


@pytest.mark.unit
def test_a_ctrl_c_while_the_processes_start_is_not_lost():
    """A Ctrl-C that arrives while the plan starts its processes (each of them started with SIGINT ignored)
    still stops the plan: on a loaded machine the starts take seconds."""
    import signal

    from analysis.plan.device import started

    class SignalledWhileStarting:  # a process whose start is interrupted by the terminal's Ctrl-C
        pid = None

        def start(self):
            os.kill(os.getpid(), signal.SIGINT)

    # Python's own handler, as in a process a terminal started (one started in the background ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):  # raised during the starts, or in the body at the latest
            with started([SignalledWhileStarting()]):
                time.sleep(0.5)
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.distributed  # all_reduce timed between two local processes
def test_this_machine_is_calibrated_on_the_real_model_and_link():
    """--gpu here: the model's forward and backward timed at two micro-batches (time grows with the
    micro-batch), the recompute of full and selective checkpointing timed, and all_reduce timed between
    two local processes; a candidate's step is predicted from them."""
    here = plan.here_device(TINY, 2, 2, 0.5, (1, 8))
    assert here.sample_s > 0 and here.optimizer_s > 0 and set(here.recompute) == {"full", "selective"}
    assert "in 2 processes at once" in here.notes[0] and "train.py's own step at --backend single" in here.notes[0]
    assert 0 < here.inside.gb_s < float("inf") and here.inside.latency_us > 0
    row = plan.evaluate(plan.Candidate("ddp", 4, 2, "none"), TINY, 2, 2, 10.0, here)
    assert row["compute_ms"] == pytest.approx((2 * here.micro_step_s + 8 * here.sample_s + here.optimizer_s) * 1e3)
    # the tiny preset's gradients fit DDP's 1 MiB first bucket: all of the all-reduce waits after backward
    assert row["comm_ms"] == 0 < row["wait_ms"] and row["pred_samples_per_s"] == pytest.approx(16 / (row["step_ms"] / 1e3))


def test_the_calibrations_step_is_train_pys_own_loop(monkeypatch):
    """On a CPU what a step does beyond its micro-steps (the batch drawn from the dataset, the gradients
    clipped and zeroed, the learning rate moved, the optimizer) is timed in train.py's own loop at
    --backend single, in this process, in a scratch directory: on the zoo's ViT that step took 15.0 ms
    where the calibrated forward, backward and optimizer summed to 6.4. Priced with the optimizer step
    where it is more than the optimizer alone; the process's threads and SIGTERM handler left as they were."""
    import signal

    from analysis.plan import device

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    handler = signal.getsignal(signal.SIGTERM)
    from training import trackers

    started = []
    real = trackers.Trackers

    def recorded(names, *args, **kwargs):
        started.append(names)
        return real(names, *args, **kwargs)

    monkeypatch.setattr(trackers, "Trackers", recorded)
    steps = device.loop_step_times([*TINY, "--tracker", "csv"], 4, steps=5)
    assert len(steps) == 5 - 2 - 1 and min(steps) > 0  # 2 warm-up, the last profiled
    assert started and not any(started), started  # a scratch run: not the user's trackers
    assert "OMP_NUM_THREADS" not in os.environ and signal.getsignal(signal.SIGTERM) is handler
    c = {"micro_step_s": 0.002, "sample_s": 0.001, "optimizer_s": 0.001}
    monkeypatch.setattr(device, "loop_step_times", lambda argv, micro: [0.03, 0.02, 0.01])
    looped = device.with_loop(c, TINY, 8)
    assert looped["optimizer_s"] == pytest.approx(0.02 - 0.002 - 8 * 0.001)  # the loop's median step
    assert looped["loop"] == {"micro_batch": 8, "step_s": 0.02, "optimizer_alone_s": 0.001,
                              "steps_s": [0.03, 0.02, 0.01]}
    assert "train.py's own step at --backend single, micro-batch 8: 20.0 ms;" in device.loop_note(looped)
    monkeypatch.setattr(device, "loop_step_times", lambda argv, micro: [0.005])  # less than the micro-step's
    assert device.with_loop(c, TINY, 8)["optimizer_s"] == 0.001


def test_a_synchronized_step_is_the_median_of_the_slowest_ranks():
    """Ranks that wait for one another every step take the slowest one's time: the median of the
    slowest of one step drawn from each rank's own steps, which every pair (or triple) of steps
    spells out one by one; never below the slowest rank's own median."""
    import itertools
    import random

    from analysis.plan.device import synchronized_median

    assert synchronized_median([[1.0, 2.0]]) == 1.0  # one rank: the lower median of its own steps
    assert synchronized_median([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]]) == 2.0
    # two ranks each at 10 ms half the time and 20 the other: a synchronized step is 20 three times in four
    assert synchronized_median([[0.01, 0.02], [0.01, 0.02]]) == 0.02
    rng = random.Random(0)
    for ranks in (2, 3):
        steps = [[rng.uniform(0.01, 0.03) for _ in range(rng.randint(3, 9))] for _ in range(ranks)]
        slowest = sorted(max(draw) for draw in itertools.product(*steps))
        got = synchronized_median(steps)
        assert sum(s <= got for s in slowest) >= len(slowest) / 2 > sum(s < got for s in slowest)
        assert got >= max(sorted(s)[(len(s) - 1) // 2] for s in steps)
    with pytest.raises(ValueError):
        synchronized_median([[], []])


def test_processes_timed_at_once_are_one_calibration_whose_loop_is_the_synchronized_step():
    """The micro-step's figures the processes' mean; train.py's loop the step of ranks in step, the
    optimizer's share what it takes beyond the mean micro-step, each process's own median kept and
    named in the plan's note."""
    from analysis.plan import device

    def one(micro_step, steps):
        c = {"micro_step_s": micro_step, "sample_s": 0.001, "optimizer_s": 0.002, "recompute": {"full": 0.5},
             "timed": {1: micro_step + 0.001, 8: micro_step + 0.008}}
        return device.with_loop(c, [], 8, steps)

    got = [one(0.002, [0.010, 0.012, 0.014]), one(0.004, [0.016, 0.018, 0.020])]
    c = device.together(got)
    assert c["micro_step_s"] == pytest.approx(0.003) and c["sample_s"] == pytest.approx(0.001)
    assert c["loop"]["step_s"] == 0.018 and c["loop"]["ranks_step_s"] == [0.012, 0.018]  # the slower one's here
    assert c["optimizer_s"] == pytest.approx(0.018 - 0.003 - 8 * 0.001)
    assert c["timed"] == {1: pytest.approx(0.004), 8: pytest.approx(0.011)} and c["recompute"] == {"full": 0.5}
    assert "18.0 ms in 2 processes at once" in device.loop_note(c) and "12.0, 18.0" in device.loop_note(c)
    # a loop shorter than the micro-steps: the optimizer alone
    fast = device.together([one(0.002, [0.001]), one(0.002, [0.001])])
    assert fast["optimizer_s"] == pytest.approx(0.002)


@pytest.mark.launch
def test_a_calibration_process_that_ends_without_a_word_fails_the_plan_not_hangs_it():
    """gather_messages (calibrate_together's wait for its processes' figures): one message a process,
    as they come; a process that ends without one (here: os._exit(3), as a killed or mis-started one)
    raises naming its exit code, and the one still running is stopped, where the wait was for ever."""
    import multiprocessing as mp
    import time

    from analysis.plan.device import gather_messages

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=queue.put, args=({"rank": r},)) for r in range(2)]
    for p in procs:
        p.start()
    assert sorted(m["rank"] for m in gather_messages(queue, procs, "two")) == [0, 1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=os._exit, args=(3,)), ctx.Process(target=time.sleep, args=(60,))]
    for p in procs:
        p.start()
    with pytest.raises(RuntimeError, match="a process ended without a word .*3"):
        gather_messages(queue, procs, "the calibration in 2 processes", poll_s=0.2)
    procs[1].join(10)
    assert procs[1].exitcode is not None  # stopped, not left running


def test_the_calibration_times_its_two_micro_batches_taking_turns(monkeypatch):
    """Each shape's first call is not timed, then the two micro-batches take turns, so neither is timed
    alone in the machine's first seconds (an H100 timed the first at 59 ms where the runs said 43:
    runs/reference/nvidia-h100-80gb-hbm3-plan)."""
    from estimator import ckpt_plan
    from simulation.describe import resolve_flags

    order, first = [], []
    real = ckpt_plan.forward_backward

    def recorded(model, x, y, precision):
        first.append(x.shape[0] not in order)
        order.append(x.shape[0])
        real(model, x, y, precision)

    def clock(dev, fn):  # each shape's first call "takes" 1000 s, the others 1 ms: no wall clock
        calls = len(first)
        fn()
        return 1000.0 if len(first) > calls and first[-1] else 0.001

    monkeypatch.setattr(ckpt_plan, "forward_backward", recorded)
    monkeypatch.setattr(ckpt_plan, "seconds_of", clock)
    setup = resolve_flags([*TINY, "--backend", "single"], 1)
    c = plan.calibrate(setup.workload, setup.cfg.block_class, (2, 8), "cpu", setup.cfg.save_ops(), reps=1)
    assert order[:4] == [2, 8, 2, 8], order
    assert max(c["timed"].values()) < 1000, c["timed"]  # one timed call each: not the slow first


def test_here_is_calibrated_where_the_candidates_run(monkeypatch, capsys):
    """--gpu here calibrates with the micro-batches the candidates use (--micro_batches narrows them):
    on a GPU the smallest and largest (from micro-batch 1, a launch-bound GPU step overstated the fixed
    cost of a micro-step threefold: runs/reference/nvidia-h200); on a CPU the largest and the smallest
    but at most an eighth of it (between 4 and 8 the line's intercept is 2 t(4) - t(8), twice the
    noise of t(4): it put 238 ms on every micro-step of GPT-lite small here, 1 and 8 none)."""
    asked = []

    def here(train_argv, world, per_node, overlap, micro_batches, shipped_link=False):
        asked.append(tuple(micro_batches))
        return plan.Device("here (stub)", plan.Link(1.0, 1.0, "stub"), plan.Link(1.0, 1.0, "stub"),
                           micro_step_s=0.01, sample_s=0.001)

    monkeypatch.setattr(plan, "here_device", here)
    question = ["--world", "1", "--mem_budget_gb", "10", "--global_batch", "16", "--configs", "single", "--ckpt",
                "none", "--json", *TINY]
    assert plan.main([*question, "--micro_batches", "2", "8"]) == 0
    saved = json.loads(capsys.readouterr().out)  # what plan.replay re-prices the plan from
    assert saved["calibration"] == {"micro_step_s": 0.01, "sample_s": 0.001, "optimizer_s": 0.0, "recompute": {}}
    assert plan.main(question) == 0
    assert plan.main([*question, "--micro_batches", "4"]) == 0
    capsys.readouterr()
    assert asked == [(2, 8), (1, 2, 4, 8, 16), (4,)]
    points = plan.calibration_points
    assert [points([4, 8], False), points([4, 8], True)] == [(1, 8), (4, 8)]
    assert [points([16, 32], False), points([16, 32], True)] == [(4, 32), (16, 32)]
    assert points([8, 16, 32, 64], False) == points([8, 16, 32, 64], True) == (8, 64)
    assert [points([4], False), points([4], True), points([1], False)] == [(1, 4), (4, 8), (1, 2)]


def test_to_verify_takes_the_top_and_two_from_further_down():
    """Two further down: the best of each backend the top leaves out, then of each configuration (a
    variant counts as its configuration), else a third and two thirds of the way down."""
    rows = [{"fits": True, "i": i, "config": "ddp"} for i in range(10)] + [{"fits": False, "i": 10, "config": "z2"}]
    assert [r["i"] for r in plan.to_verify(rows, 3)] == [0, 1, 2, 3 + 7 // 3, 3 + 14 // 3]
    assert [r["i"] for r in plan.to_verify(rows[:2], 1)] == [0, 1]
    configs = ["a", "b", "a", "b", "v", "c", "a", "d", "c"]
    rows = [{"fits": True, "i": i, "config": c, **({"base": "a"} if c == "v" else {})} for i, c in enumerate(configs)]
    assert [r["i"] for r in plan.to_verify(rows, 2)] == [0, 1, 5, 7]  # c and d: v is a's
    assert [r["i"] for r in plan.to_verify(rows[:6], 3)] == [0, 1, 2, 5, 3]  # c, then a third of the way down
    backends = {"a": "fsdp", "b": "fsdp", "v": "fsdp", "c": "fsdp", "d": "ddp"}
    rows = [{**r, "backend": backends[r["config"]]} for r in rows]
    assert [r["i"] for r in plan.to_verify(rows, 2)] == [0, 1, 7, 5]  # ddp (d) first, then the file c
    assert plan.flag_pairs(["--preset", "tiny", "--compile", "--steps", "3"]) == (
        ("preset", "tiny"), ("compile", True), ("steps", "3"))


def _fake_runner(monkeypatch, speeds: dict, peak=lambda config, rate: 0.5):
    """orchestration.runner.Runner replaced: each run's samples/s from `speeds` by its configuration's
    name, given its steps (a callable, or a number; None: out of memory), its peak in GiB
    peak(config, rate), each run 10 s. Returns the (name, steps) of the runs, in order."""
    from types import SimpleNamespace

    import orchestration.runner

    ran = []

    class Runner:  # orchestration/runner.LocalSweep's runner
        def __init__(self, directory, timeout_s, retry_failed=False):
            self.directory_lock = SimpleNamespace(release=lambda: None)

        def hold_directory(self):
            return self.directory_lock

        def check_records(self, runs):
            pass

        def run(self, planned):
            steps = int(dict(planned.flags)["steps"])
            ran.append((planned.name, steps))
            config = planned.name.split("-")[1]
            rate = speeds[config](steps) if callable(speeds[config]) else speeds[config]
            summary = SimpleNamespace(samples_per_s=rate, samples_per_s_p25=rate and rate * 0.95,
                                      samples_per_s_p75=rate and rate * 1.05,
                                      mem_peak_bytes=peak(config, rate) * 2**30)
            return SimpleNamespace(status="ok" if rate else "oom", summary=summary, line=lambda: planned.name,
                                   seconds=10.0, skipped=False)

    monkeypatch.setattr(orchestration.runner, "Runner", Runner)
    return ran


def test_verify_rounds_take_turns_and_take_each_candidates_median(tmp_path, monkeypatch):
    """--verify_rounds 3: every verified candidate once, then again (the machine's speed drifts between
    runs), each its own record; a candidate's samples/s the median of its runs, its spread from the
    lowest lower quartile to the highest upper one, its peak the highest; one failed run and it is not ok."""
    speeds = {"a": [9.0, 6.0, 8.0], "b": [7.0, 7.5, 7.2], "c": [5.0, None, 5.2]}  # None: out of memory at 7 GiB

    def speed(config):  # each configuration's runs in turn
        return lambda steps: speeds[config][sum(n.split("-")[1] == config for n, _ in ran) - 1]

    ran = _fake_runner(monkeypatch, {c: speed(c) for c in speeds}, peak=lambda config, rate: rate or 7.0)
    rows = [{"candidate": plan.Candidate(c, 4, 2, "none"), "backend": "ddp", "command": f"run {c}", "fits": True,
             "pred_samples_per_s": 10.0 - i, "est_peak_gb": 1.0} for i, c in enumerate("abc")]
    verified = plan.verify(rows, 1, TINY, 2, tmp_path, 8, 60, rounds=3)
    assert [n for n, _ in ran] == [f"plan-{c}-mb4x2-none{r}" for r in ("", "-r1", "-r2") for c in "abc"]
    a, b, c = verified
    assert a["measured_samples_per_s"] == 8.0 and a["measured_runs"] == [9.0, 6.0, 8.0]
    # several runs: the spread is their range (one run's: its timed steps' quartiles)
    assert a["measured_spread"] == [6.0, 9.0] and a["measured_peak_gb"] == 9.0
    assert a["records"] == [str(tmp_path / f"plan-a-mb4x2-none{r}") for r in ("", "-r1", "-r2")]
    assert a["status"] == b["status"] == "ok" and b["measured_samples_per_s"] == 7.2
    assert c["status"] == "oom" and c["measured_runs"] == [5.0, None, 5.2]
    assert c["measured_samples_per_s"] == 5.1 and c["measured_spread"] == [5.0, 5.2]
    assert c["measured_peak_gb"] == 7.0  # the out-of-memory run's peak, from its record
    # the spreads of a (6 to 9) and b (7 to 7.5) overlap: a tie, not a win; c's (5 to 5.2) does not
    assert plan._ties(a, [a, b, c]) == ["run b"]
    ran.clear()
    one = plan.verify(rows, 1, TINY, 2, tmp_path / "one", 8, 60)  # one round: a run's timed steps' quartiles
    assert one[0]["measured_spread"] == pytest.approx([9.0 * 0.95, 9.0 * 1.05]) and "records" not in one[0]


@pytest.mark.distributed
def test_verify_runs_the_top_candidate_and_two_more_and_picks_the_fastest_measured(tmp_path, forked_launchers):
    """--verify 1 on the tiny preset: three real runs through the sweep runner (2 ranks, forked:
    conftest.forked_launchers), ordinary records, predicted beside measured, and the pick the fastest
    measured within the budget."""
    runs = tmp_path / "runs"
    proc = _here("--world", "2", "--mem_budget_gb", "1", "--global_batch", "16", "--configs", "ddp", "--ckpt", "none",
                "full/1", "--micro_batches", "4", "8", "--verify", "1", "--verify_steps", "4", "--runs_dir", str(runs),
                "--json", "--out", str(tmp_path / "plan"), "--backend_costs", "off", *TINY)  # what is verified, not priced
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    verified = out["verified"]
    # --out holds the verification too: predicted against measured, the refit, and the pick.
    text = (tmp_path / "plan" / "plan.md").read_text()
    assert "predicted against measured" in text and "refitted on 3 verified candidates" in text
    assert f"pick (fastest measured within the budget): {out['pick']}" in text
    assert set(out["refit"]["overhead"]) == {"ddp"}
    assert len(verified) == 3 and verified[0]["rank"] == 1 and len({v["command"] for v in verified}) == 3
    for v in verified:
        assert v["status"] == "ok" and 0 < v["measured_peak_gb"] <= 1 and v["measured_samples_per_s"] > 0
        # The estimate holds every verified run's peak within 10%, the accumulating 4x2 ones too (DDP's
        # gradients made apart from its buckets under no_sync: -11.8% here before they were counted).
        assert v["est_peak_gb"] == pytest.approx(v["measured_peak_gb"], rel=0.10), v
        assert json.loads((Path(v["record"]) / "summary.json").read_text())["status"] == "ok"
    assert out["pick"] == max(verified, key=lambda v: v["measured_samples_per_s"])["command"]
    assert proc.stderr.count("[1/3]") == 2 and "[3/3]" in proc.stderr  # a line as each starts and ends
    # Ties: the verified runs whose spread (timed steps' quartiles) overlaps the pick's.
    best = next(v for v in verified if v["command"] == out["pick"])
    for v in verified:
        low, high = v["measured_spread"]
        assert low <= v["measured_samples_per_s"] <= high
    assert out["ties_with_pick"] == [v["command"] for v in verified if v is not best and
                                     max(v["measured_spread"][0], best["measured_spread"][0])
                                     <= min(v["measured_spread"][1], best["measured_spread"][1])]


def test_the_refit_recovers_the_compute_factor_and_overlap_of_the_measured_runs():
    """Runs measured as 2 x compute + 0.3 x comm: the refit finds factor 2 and overlap 0.7, and ranks
    every candidate by the refitted model; an overlap past its bounds is held at the bound."""
    rows = [{"command": f"c{i}", "compute_ms": c, "comm_ms": m, "offload_ms": 0.0, "fits": True}
            for i, (c, m) in enumerate([(100, 50), (200, 10), (150, 300), (120, 80)])]
    verified = [{"command": r["command"], "status": "ok",
                 "measured_samples_per_s": 8 / ((2 * r["compute_ms"] + 0.3 * r["comm_ms"]) / 1e3)} for r in rows[:3]]
    fitted = plan.refit(rows, verified, 8)
    assert fitted["compute_factor"] == pytest.approx(2) and fitted["overlap"] == pytest.approx(0.7)
    assert rows[3]["refit_samples_per_s"] == pytest.approx(8 / ((2 * 120 + 0.3 * 80) / 1e3))
    assert verified[0]["refit_samples_per_s"] == pytest.approx(verified[0]["measured_samples_per_s"])
    slower = [{**v, "measured_samples_per_s": 8 / ((r["compute_ms"] + 2 * r["comm_ms"]) / 1e3)}
              for v, r in zip(verified, rows)]  # more than all of the communication exposed: held at overlap 0
    assert plan.refit(rows, slower, 8)["overlap"] == 0
    assert plan.refit(rows, verified[:1], 8) is None


def test_the_refit_gives_the_micro_steps_fixed_cost_its_own_factor_where_accumulations_differ():
    """A calibration that overstated each micro-step's fixed cost (an H100's: 26 ms where the runs said
    6.5, and 8 x 8 refitted 26% under): runs measured as 0.25 x that cost + 1.2 x the rest of compute +
    0.3 x comm are fitted exactly when the verified runs accumulate differently, and a candidate not
    run is predicted as it would measure; verified at one accumulation, the one compute factor stays."""
    shapes = [("8x8", 8), ("32x2", 2), ("64x1", 1), ("16x4", 4), ("8x8", 8)]
    rows = [{"command": f"c{i}", "config": "single", "micro x accum": mxa, "compute_ms": 300 + 5 * i + 26 * accum,
             "micro_steps_ms": 26 * accum, "comm_ms": 10 * i, "offload_ms": 0.0, "fits": True}
            for i, (mxa, accum) in enumerate(shapes)]

    def measured(r):
        fixed = r["micro_steps_ms"]
        return 64 / ((0.25 * fixed + 1.2 * (r["compute_ms"] - fixed) + 0.3 * r["comm_ms"]) / 1e3)

    verified = [{"command": r["command"], "status": "ok", "measured_samples_per_s": measured(r)} for r in rows[:4]]
    fitted = plan.refit(rows, verified, 64)
    assert fitted["micro_step_factor"] == pytest.approx(0.25) and fitted["compute_factor"] == pytest.approx(1.2)
    assert fitted["overlap"] == pytest.approx(0.7) and fitted["overhead"] == {"single": pytest.approx(1.0)}
    assert rows[4]["refit_samples_per_s"] == pytest.approx(measured(rows[4]))
    same = [{**r, "micro x accum": "32x2"} for r in rows]  # one accumulation: the split is not identifiable
    assert "micro_step_factor" not in plan.refit(same, verified, 64)
    assert "micro_step_factor" not in plan.refit(rows, verified[:3], 64)  # 3 runs, 3 parameters: none to spare
    flat = [{**r, "compute_ms": 300 + r["micro_steps_ms"], "comm_ms": 40} for r in rows]  # DDP, no checkpointing:
    assert "micro_step_factor" not in plan.refit(flat, verified, 64)  # the rest of compute and comm both constant


def test_replay_rebuilds_the_micro_steps_of_a_plan_saved_without_them():
    """A plan saved before its candidates carried micro_steps_ms: replay rebuilds each from the printed
    calibration line as evaluate computed it (to the line's rounding), and from --json's `calibration`
    exactly; then refits as refit does on the rows that had them."""
    cal = {"micro_step_s": 0.01234, "sample_s": 0.004567, "optimizer_s": 0.0031, "recompute": {"full": 0.3,
                                                                                                 "selective": 0.1}}
    link = plan.Link(1.0, 1.0, "stub")
    device = plan.Device("here (stub)", link, link, **cal)
    rows = [{k: v for k, v in r.items() if k != "candidate"} for r in
            plan.plan(TINY, 1, 1, 10.0, 16, device, ["single"], ("none", "full/1", "selective/2"), [2, 8, 16])]
    assert len({r["micro_steps_ms"] for r in rows}) > 3  # accumulation and recompute both vary
    verified = [{"command": r["command"], "status": "ok", "pred_samples_per_s": r["pred_samples_per_s"],
                 "measured_samples_per_s": r["pred_samples_per_s"] * (0.8 + 0.1 * i)} for i, r in enumerate(rows[:5])]
    before = [{k: v for k, v in r.items() if k != "micro_steps_ms"} for r in rows]
    printed = {"assumptions": [f"compute calibrated on cpu: ...; {plan.calibration_line(cal)}; recompute ..."],
               "candidates": before, "verified": verified}
    for saved, tolerance in (({**printed, "calibration": cal}, 1e-9), (printed, 0.02)):
        out = plan.replay(saved)
        assert [r["micro_steps_ms"] for r in out["candidates"]] == pytest.approx(
            [r["micro_steps_ms"] for r in rows], rel=tolerance)
    expected = [dict(r) for r in rows]
    fitted = plan.refit(expected, [dict(v) for v in verified], 16)
    out = plan.replay({**printed, "calibration": cal})
    assert out["global_batch"] == 16 and out["refit"].keys() == fitted.keys()
    assert out["refit"]["overhead"] == {"single": pytest.approx(fitted["overhead"]["single"])}
    assert {k: v for k, v in out["refit"].items() if k != "overhead"} == pytest.approx(
        {k: v for k, v in fitted.items() if k != "overhead"})
    assert [v["refit_samples_per_s"] for v in out["verified"]] == pytest.approx(
        [r["refit_samples_per_s"] for r in expected[:5]])
    with pytest.raises(ValueError, match="no verified runs"):
        plan.replay({**printed, "verified": []})
    with pytest.raises(ValueError, match="fewer than 2 verified runs measured"):
        plan.replay({**printed, "verified": [verified[0], {**verified[1], "status": "oom"}]})


def test_the_refit_gives_each_verified_configuration_its_own_overhead():
    """A configuration measured 25% slower than its communication and compute say (ZeRO-3's gathers on
    this machine) gets its own overhead, applied to its candidates that were not run; a configuration
    not verified keeps the shared fit."""
    costs = [("ddp", 100, 20), ("ddp", 150, 20), ("z3", 100, 40), ("z3", 130, 40), ("fsdp2", 110, 30)]
    rows = [{"command": f"c{i}", "config": c, "compute_ms": t, "comm_ms": m, "offload_ms": 0.0, "fits": True}
            for i, (c, t, m) in enumerate(costs)]

    def measured(r):
        return 8 / ((1.5 * r["compute_ms"] + r["comm_ms"]) * (1.25 if r["config"] == "z3" else 1.0) / 1e3)

    verified = [{"command": r["command"], "status": "ok", "measured_samples_per_s": measured(r)} for r in rows[:3]]
    fitted = plan.refit(rows, verified, 8)
    assert set(fitted["overhead"]) == {"ddp", "z3"}
    assert fitted["overhead"]["z3"] / fitted["overhead"]["ddp"] == pytest.approx(1.25, rel=0.05)
    shared = 8 / ((fitted["compute_factor"] * 130 + (1 - fitted["overlap"]) * 40) / 1e3)
    assert rows[3]["refit_samples_per_s"] == pytest.approx(shared / fitted["overhead"]["z3"])
    assert rows[3]["refit_samples_per_s"] == pytest.approx(measured(rows[3]), rel=0.05)
    assert rows[4]["refit_samples_per_s"] == pytest.approx(
        8 / ((fitted["compute_factor"] * 110 + (1 - fitted["overlap"]) * 30) / 1e3))


VARIED = ["ds_configs/z2.json", "ds_configs/z3.json", "fsdp_configs/full_shard.yaml", "fsdp_configs/fsdp2.yaml", "ddp"]


def test_variants_are_written_as_files_train_py_resolves_and_priced_by_what_they_change(tmp_path):
    """--variants: ZeRO-2's smaller buckets cost more calls and less memory, larger ones the reverse;
    ZeRO-3 without prefetch and FSDP without backward prefetch put gathers on the critical path
    (wait), the same bytes; DDP's buckets are flags (no file): smaller ones more calls and less
    waiting after backward; a variant shares its configuration's refitted overhead."""
    bases = plan.write_variants(VARIED, str(tmp_path / "v"))
    names = sorted(Path(v).name for v in bases if v.endswith((".json", ".yaml")))
    assert names == ["full_shard.no_backward_prefetch.yaml", "z2.buckets_quarter.json", "z2.buckets_x4.json",
                     "z3.no_prefetch.json", "z3.persistence_x100.json"]  # fsdp2: none; ddp: flags
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == names
    assert {v: b for v, b in bases.items() if b == "ddp"} == {"ddp --ddp_bucket_cap_mb 6.25": "ddp",
                                                              "ddp --ddp_bucket_cap_mb 100": "ddp"}
    rows = plan.plan(["--preset", "small"], 8, 8, 10.0, 64, h100(), [*VARIED, *bases], ("none",), [8], bases=bases)
    by = {Path(r["config"]).name: r for r in rows}
    assert all("refused" not in r for r in rows), [r.get("refused") for r in rows]
    quarter, x4, z2 = by["z2.buckets_quarter.json"], by["z2.buckets_x4.json"], by["z2.json"]
    assert quarter["comm_ms"] > z2["comm_ms"] > x4["comm_ms"]  # latency per call: 4x the calls, a quarter
    assert quarter["est_peak_gb"] < z2["est_peak_gb"] < x4["est_peak_gb"]  # the buckets are allocated whole
    for variant, base in (("z3.no_prefetch.json", "z3.json"), ("full_shard.no_backward_prefetch.yaml", "full_shard.yaml")):
        assert by[base]["wait_ms"] == 0 < by[variant]["wait_ms"]
        assert by[variant]["pred_samples_per_s"] < by[base]["pred_samples_per_s"]
        assert by[variant]["base"] == f"{'ds_configs' if base.endswith('json') else 'fsdp_configs'}/{base}"
    assert by["z3.no_prefetch.json"]["comm_ms"] + by["z3.no_prefetch.json"]["wait_ms"] == pytest.approx(
        by["z3.json"]["comm_ms"])  # the same bytes and calls
    assert by["z3.no_prefetch.json"]["est_peak_gb"] <= by["z3.json"]["est_peak_gb"]
    # more parameters kept whole: the estimator reads it; the theory's bytes do not (--counted does)
    assert by["z3.persistence_x100.json"]["est_peak_gb"] != by["z3.json"]["est_peak_gb"]
    assert by["z3.persistence_x100.json"]["step_ms"] == by["z3.json"]["step_ms"]
    command = shlex.split(by["z3.no_prefetch.json"]["command"])
    assert command[command.index("--deepspeed_config") + 1] == str(tmp_path / "v" / "z3.no_prefetch.json")
    ran = dry_run(["--preset", "small", *by["z3.no_prefetch.json"]["candidate"].flags()], 8)
    assert ran["plan"]["config"]["zero_optimization"]["stage3_prefetch_bucket_size"] == 0
    # DDP of GPT-lite small (10960896 bytes of fp32 gradients): by default a first bucket of 1234944 bytes
    # (1 MiB or more) and the rest, 9725952, waiting after backward; 6.25 MiB buckets, 6566400 and
    # 4394496 waiting; 100 MiB, one bucket, all of it waiting
    quarter, x4, ddp = by["ddp --ddp_bucket_cap_mb 6.25"], by["ddp --ddp_bucket_cap_mb 100"], by["ddp"]
    assert quarter["base"] == x4["base"] == "ddp"
    total = 2740224 * 4
    for row, waits, calls in ((ddp, 9725952 / total, 2), (quarter, 4394496 / total, 2), (x4, 1.0, 1)):
        assert row["wait_ms"] / (row["comm_ms"] + row["wait_ms"]) == pytest.approx(waits)
        assert row["calls"] == calls
    assert quarter["est_peak_gb"] == ddp["est_peak_gb"] == x4["est_peak_gb"]
    flags = quarter["candidate"].flags()
    assert flags[:4] == ["--backend", "ddp", "--ddp_bucket_cap_mb", "6.25"]
    assert quarter["candidate"].run_name() == "ddp-ddp_bucket_cap_mb-6.25-mb8x1-none"
    ran = dry_run(["--preset", "small", *flags], 8)
    assert ran["run"]["ddp_bucket_cap_mb"] == 6.25 and ran["run"]["backend"] == "ddp"


def test_variants_are_not_rewritten(tmp_path):
    """The same variants again reuse the files; a file of that name with other contents is refused
    before anything is written."""
    first = plan.write_variants(["ds_configs/z3.json"], str(tmp_path))
    mtimes = {p: Path(p).stat().st_mtime_ns for p in first}
    assert plan.write_variants(["ds_configs/z3.json"], str(tmp_path)) == first
    assert {p: Path(p).stat().st_mtime_ns for p in first} == mtimes
    (tmp_path / "z2.buckets_quarter.json").mkdir()  # not a file: refused too, in one line
    with pytest.raises(ConfigError, match="z2.buckets_quarter.json exists with other contents"):
        plan.write_variants(["ds_configs/z2.json"], str(tmp_path))
    (tmp_path / "z2.buckets_quarter.json").rmdir()
    (tmp_path / "z2.buckets_x4.json").write_text("{}\n")
    with pytest.raises(ConfigError, match="z2.buckets_x4.json exists with other contents"):
        plan.write_variants(["ds_configs/z2.json"], str(tmp_path))
    assert not (tmp_path / "z2.buckets_quarter.json").exists()
    assert (tmp_path / "z2.buckets_x4.json").read_text() == "{}\n"


def _schedule(*flags: str) -> dict:
    from simulation.describe import resolve_flags

    setup = resolve_flags([*TINY, *flags], 2, 2)
    return setup.resolved.build(setup.env).comm_schedule(setup.workload.param_sizes)


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


def test_the_refit_leaves_waiting_communication_unscaled_and_counts_a_variant_as_its_configuration():
    """Runs measured as exactly 1.5 x compute + 0.5 x comm + wait, one of them a variant with waiting
    gathers: the refit recovers the factor and overlap (with the waiting part scaled, three runs
    would not fit two parameters exactly), the variant's runs count toward its configuration's
    overhead (no overhead of its own), and its other candidates are predicted as measured."""
    costs = [("ddp", None, 100, 20, 0), ("ddp", None, 150, 60, 0), ("ddp.v", "ddp", 100, 40, 20),
             ("ddp.v", "ddp", 130, 10, 20)]
    rows = [{"command": f"c{i}", "config": c, **({"base": b} if b else {}), "compute_ms": t, "comm_ms": m,
             "wait_ms": w, "offload_ms": 0.0, "fits": True} for i, (c, b, t, m, w) in enumerate(costs)]

    def measured(r):
        return 8 / ((1.5 * r["compute_ms"] + 0.5 * r["comm_ms"] + r["wait_ms"]) / 1e3)

    verified = [{"command": r["command"], "status": "ok", "measured_samples_per_s": measured(r)} for r in rows[:3]]
    fitted = plan.refit(rows, verified, 8)
    assert fitted["compute_factor"] == pytest.approx(1.5) and fitted["overlap"] == pytest.approx(0.5)
    assert fitted["overhead"] == {"ddp": pytest.approx(1.0)}
    assert rows[3]["refit_samples_per_s"] == pytest.approx(measured(rows[3]))


def test_the_race_runs_each_configurations_best_and_halves_until_two_are_left(tmp_path, monkeypatch):
    """Six configurations, two candidates each: the race's first round runs each configuration's
    best-ranked candidate (not the second), 4 steps; the faster half within the budget runs again, as
    long, ranked by the median of its runs so far, until a round has two; the pick is the faster where
    its runs resolve it, whatever the prediction said. A configuration over the budget (measured) or out of memory is
    dropped; the steps run are counted against the grid's (every fitting candidate once)."""
    runs: dict[str, list] = {"a": [5.0], "b": [9.0, 9.2, 6.5], "c": [7.0], "d": [10.0, 10.0, 8.0], "e": [None],
                             "f": [10.0], "g": [6.0], "h": [7.5, 7.0]}

    def speed(config):  # each configuration's runs in turn
        return lambda steps: runs[config][sum(n.split("-")[1] == config for n, _ in ran) - 1]

    ran = _fake_runner(monkeypatch, {c: speed(c) for c in runs}, peak=lambda config, rate: 3.0 if config == "f" else 0.5)  # f: over the 1 GiB budget
    rows = [{"candidate": plan.Candidate(c, m, 8 // m, "none"), "config": c, "backend": "ddp", "fits": True,
             "command": f"run {c} {m}", "pred_samples_per_s": 20.0 - i, "est_peak_gb": 0.5}
            for i, (m, c) in enumerate((m, c) for m in (8, 4) for c in "abcdef")]
    rows.append({"candidate": plan.Candidate("z", 8, 1, "none"), "config": "z", "fits": False, "command": "run z"})
    assert [r["command"] for r in plan.entrants(rows)] == [f"run {c} 8" for c in "abcdef"]
    raced = plan.race(rows, TINY, 2, tmp_path, 4, 60, budget_gb=1.0, share=None)
    # round 0: ok within the budget d 10, b 9, c 7, a 5 (e out of memory, f over): two go on, d and b;
    # two raced: d's median (10, 10) 10, b's (9, 9.2) 9.1, 10% apart where their runs lie 2% apart: d,
    # though b was predicted faster
    assert ran == [(f"race0-{c}-mb8x1-none", 4) for c in "abcdef"] + [("race1-d-mb8x1-none", 4),
                                                                       ("race1-b-mb8x1-none", 4)]
    assert raced["pick"]["command"] == "run d 8" and raced["pick"]["race_samples_per_s"] == 10.0
    assert [m["race_samples_per_s"] for m in raced["rounds"][1]] == [10.0, 9.1] and not raced["tied"]
    assert raced["steps_run"] == 8 * 4 and raced["grid_steps"] == 12 * 4
    assert raced["runs"] == 8 and raced["grid_runs"] == 12 and raced["run_seconds"] == 80.0
    ran.clear()
    runs.update(b=[9.0, 8.5, 9.0], d=[8.0, 8.0, 8.0])
    rows8 = rows[:6] + [{**rows[0], "candidate": plan.Candidate(c, 8, 1, "none"), "config": c, "command": f"run {c} 8"}
                        for c in "gh"]
    raced = plan.race(rows8, TINY, 2, tmp_path / "eight", 4, 60, budget_gb=1.0, share=None)
    # 6 ok within budget (b 9, d 8, h 7.5, c 7, g 6, a 5) -> 3 again (b 8.75, d 8, h 7.25) -> 2 (b, d): b
    assert [n.split("-")[0] for n, _ in ran] == ["race0"] * 8 + ["race1"] * 3 + ["race2"] * 2
    assert {n.split("-")[1] for n, _ in ran[8:11]} == {"b", "d", "h"}
    assert raced["pick"]["command"] == "run b 8" and raced["pick"]["race_samples_per_s"] == 9.0
    assert raced["steps_run"] == 13 * 4


def test_the_race_enters_the_configurations_predicted_within_a_share_of_the_best(tmp_path, monkeypatch):
    """--race_within: a configuration enters only if its best-ranked candidate is predicted at least that
    share of the best candidate's (its other candidates never enter); two entrants each run twice, and
    the pick is the faster by the median of its runs where the gap is wider than the finalists' own runs
    lie apart; where it is not, the prediction breaks the tie."""
    runs = {"a": [9.0, 6.0], "b": [8.0, 8.0], "c": [20.0], "d": [20.0]}

    def speed(config):
        return lambda steps: runs[config][sum(n.split("-")[1] == config for n, _ in ran) - 1]

    ran = _fake_runner(monkeypatch, {c: speed(c) for c in runs})
    preds = {"a": 20.0, "b": 13.0, "c": 11.0, "d": 4.0}
    rows = [{"candidate": plan.Candidate(c, m, 8 // m, "none"), "config": c, "backend": "ddp", "fits": True,
             "command": f"run {c} {m}", "pred_samples_per_s": preds[c] / (1 if m == 8 else 2), "est_peak_gb": 0.5}
            for m in (8, 4) for c in "abcd"]
    rows.sort(key=lambda r: -r["pred_samples_per_s"])
    # refused, as a plan writes a configuration that cannot run the model (no command; live on the zoo's
    # GRU, 2026-12-03: the tie broke on it, KeyError, and the plan printed nothing)
    rows.append({"config": "e", "micro x accum": "8x1", "ckpt": "none", "refused": "no repeated block",
                 "config_flags": ["--backend", "e"]})
    assert [r["command"] for r in plan.entrants(rows)] == ["run a 8", "run b 8", "run c 8", "run d 8"]
    assert [r["command"] for r in plan.entrants(rows, within=0.6)] == ["run a 8", "run b 8"]  # c: 11 < 0.6 x 20
    assert [r["command"] for r in plan.entrants(rows, within=0.5)] == ["run a 8", "run b 8", "run c 8"]
    assert [r["command"] for r in plan.entrants(rows, per_family=2, within=0.6)] == [
        "run a 8", "run b 8", "run a 4", "run b 4"]  # a family in: its second too (b 4's 6.5 is below 12)
    # one configuration within: the next best-ranked join up to `least` (default 2), an entered one's own too
    assert [r["command"] for r in plan.entrants(rows, within=0.7)] == ["run a 8", "run b 8"]
    assert [r["command"] for r in plan.entrants(rows, within=0.7, least=4)] == ["run a 8", "run b 8", "run c 8", "run a 4"]
    assert [r["command"] for r in plan.entrants(rows, within=0.7, least=1)] == ["run a 8"]
    with pytest.raises(ConfigError, match="race_within must lie between 0 and 1"):
        plan.entrants(rows, within=1.5)
    raced = plan.race(rows, TINY, 2, tmp_path, 4, 60, budget_gb=1.0, within=0.6, share=None)
    # c and d, the fastest measured, never ran: left out by their predictions
    assert ran == [("race0-a-mb8x1-none", 4), ("race0-b-mb8x1-none", 4), ("race1-a-mb8x1-none", 4),
                   ("race1-b-mb8x1-none", 4)]
    # a's median (9, 6) 7.5 is below b's 8, by less than a's runs lie apart (50%): the prediction's a
    assert raced["pick"]["command"] == "run a 8" and raced["runs"] == 4 and raced["tied"]
    ran.clear()
    runs.update(a=[6.0, 6.2], b=[8.0, 8.0])  # b 29% ahead, the runs 3% apart: b, against the prediction
    raced = plan.race(rows, TINY, 2, tmp_path / "resolved", 4, 60, budget_gb=1.0, within=0.6, share=None)
    assert raced["pick"]["command"] == "run b 8" and not raced["tied"]
    # the same race, every configuration entered: c and d ran, and one of them won
    ran.clear()
    runs.update(a=[9.0, 6.0], b=[8.0, 8.0], c=[20.0, 20.0], d=[20.0, 19.0])
    raced = plan.race(rows, TINY, 2, tmp_path / "every", 4, 60, budget_gb=1.0, within=0.0, share=None)
    assert raced["pick"]["command"] in ("run c 8", "run d 8") and len(raced["rounds"][0]) == 4
    # a race of one is no race: one configuration within, two entrants, each run twice
    ran.clear()
    runs.update(a=[9.0, 9.0], b=[5.0, 5.0])
    raced = plan.race(rows, TINY, 2, tmp_path / "one", 4, 60, budget_gb=1.0, within=0.7, share=None)
    assert raced["runs"] == 4 and raced["pick"]["command"] == "run a 8"


def test_the_race_runs_at_most_a_quarter_of_the_grid(tmp_path, monkeypatch):
    """RACE_SHARE (issue 40: the pick within 5% of the grid's best using at most a quarter of its run
    time): on 8 fitting candidates, 2 runs at most: the two best-ranked entrants run once, and the
    faster is the pick, with no second round; on 16, 4 runs: four entrants, then the faster two would
    make 6, so no second round either. Unbounded (share None) the same race runs its halving."""
    runs = {"a": [6.0, 6.0], "b": [8.0, 8.0], "c": [7.0, 7.0], "d": [5.0, 5.0]}

    def speed(config):
        return lambda steps: runs[config][sum(n.split("-")[1] == config for n, _ in ran) - 1]

    ran = _fake_runner(monkeypatch, {c: speed(c) for c in runs})
    preds = {"a": 20.0, "b": 19.0, "c": 18.0, "d": 17.0}

    def rows_of(micro_batches):
        rows = [{"candidate": plan.Candidate(c, m, 8 // m, "none"), "config": c, "backend": "ddp", "fits": True,
                 "command": f"run {c} {m}", "pred_samples_per_s": preds[c] / (8 // m), "est_peak_gb": 0.5}
                for m in micro_batches for c in "abcd"]
        return sorted(rows, key=lambda r: -r["pred_samples_per_s"])

    raced = plan.race(rows_of((8, 4)), TINY, 2, tmp_path / "eight", 4, 60, budget_gb=1.0)
    assert ran == [("race0-a-mb8x1-none", 4), ("race0-b-mb8x1-none", 4)]  # c and d, within, left out by the bound
    assert raced["runs"] == 2 and raced["grid_runs"] == 8 and raced["pick"]["command"] == "run b 8"
    ran.clear()
    raced = plan.race(rows_of((8, 4, 2, 1)), TINY, 2, tmp_path / "sixteen", 4, 60, budget_gb=1.0)
    assert [n for n, _ in ran] == [f"race0-{c}-mb8x1-none" for c in "abcd"]
    assert raced["runs"] == 4 and raced["pick"]["command"] == "run b 8"
    ran.clear()
    raced = plan.race(rows_of((8, 4)), TINY, 2, tmp_path / "unbounded", 4, 60, budget_gb=1.0, share=None)
    assert raced["runs"] == 6 and raced["pick"]["command"] == "run b 8"  # 4, then b and c again


def test_backend_costs_are_fitted_from_the_probe_runs_and_kept_per_machine(tmp_path, monkeypatch):
    """The three probe points' residuals give back the per-step, per-micro-step and per-tensor costs
    they were made of; they are kept in $GPTLITE_CACHE/backend_costs.json per configuration and world,
    measured again when the machine (or the file) changes; with `measure_missing` off the others are
    listed, not measured; a configuration whose probe fails is listed, and the plan goes on."""
    from analysis.plan import backend_costs as bc
    from analysis.plan import probe

    truth = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 1e-4}
    tensors = {2: 10, 12: 50}
    residuals = {(layers, m, a): bc.cost_seconds(truth, a, tensors[layers]) for layers, m, a in bc.POINTS}
    assert bc.fit(residuals, tensors) == pytest.approx(truth)
    assert bc.fit({k: 0.0 for k in residuals}, tensors) == {"per_step_s": 0.0, "per_micro_step_s": 0.0,
                                                             "per_item_s": 0.0}
    # With the wide point: a cost per parameter told apart from the cost per tensor (the wide point has
    # two tensors more and four times the parameters); where nothing goes by the size, none is fitted.
    sized = {**truth, "per_param_s": 2e-8}
    tensors, params = {2: 10, 12: 50, "wide": 52}, {2: 9_000, 12: 52_000, "wide": 208_000}
    size = {**{p: p[0] for p in bc.POINTS}, bc.WIDE: "wide"}
    residuals = {p: bc.cost_seconds(sized, p[2], tensors[size[p]], params[size[p]]) for p in size}
    assert bc.fit(residuals, tensors, params) == pytest.approx(sized)
    assert bc.fit(residuals, tensors)["per_item_s"] > 1.2 * truth["per_item_s"]  # three points: the size in the tensors
    residuals = {p: bc.cost_seconds(truth, p[2], tensors[size[p]], params[size[p]]) for p in size}
    assert bc.fit(residuals, tensors, params) == pytest.approx({**truth, "per_param_s": 0.0})
    sizeonly = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 0.0, "per_param_s": 2e-8}
    residuals = {p: bc.cost_seconds(sizeonly, p[2], tensors[size[p]], params[size[p]]) for p in size}
    assert bc.fit(residuals, tensors, params) == pytest.approx(sizeonly, abs=1e-12)
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    measured = []

    def fake_measure(config, world, device, progress=print, *protocol):
        measured.append((config, world))
        if config == "ds_configs/z3.json":
            raise RuntimeError("its probe run did not succeed")
        return {**truth, "item": "trainable tensor"}

    monkeypatch.setattr(probe, "measure", fake_measure)
    configs = ["ddp", "fsdp_configs/fsdp2.yaml", "ds_configs/z3.json"]
    found, missing = probe.costs_for(configs, 2, None, measure_missing=False, progress=lambda line: None)
    assert (found, missing, measured) == ({}, configs, [])
    found, missing = probe.costs_for(configs, 2, None, measure_missing=True, progress=lambda line: None)
    assert set(found) == {"ddp", "fsdp_configs/fsdp2.yaml"} and missing == ["ds_configs/z3.json"]
    assert found["ddp"]["per_item_s"] == truth["per_item_s"]
    kept = json.loads((tmp_path / "backend_costs.json").read_text())
    assert len(kept) == 2 and all(e["machine"] == bc.machine() for e in kept.values())
    measured.clear()
    found, missing = probe.costs_for(configs[:2], 2, None, measure_missing=True, progress=lambda line: None)
    assert measured == [] and set(found) == set(configs[:2])  # kept: not measured again
    found, _ = probe.costs_for(["ddp"], 4, None, measure_missing=True, progress=lambda line: None)
    assert measured == [("ddp", 4)]  # another world is another measurement
    monkeypatch.setattr(probe, "machine", lambda: {"cpu": "another"})
    measured.clear()
    probe.costs_for(["ddp"], 2, None, measure_missing=True, progress=lambda line: None)
    assert measured == [("ddp", 2)]  # another machine: measured again
    assert "not measured" in bc.summary_line({}, ["ds_configs/z3.json"])
    measured.clear()  # single's step is the calibration itself: nothing of its own to measure
    assert probe.costs_for(["single"], 2, None, measure_missing=True, progress=lambda line: None) == ({}, [])
    assert measured == []


def test_backend_costs_fit_is_the_best_non_negative_one_where_the_exact_one_is_negative(tmp_path, monkeypatch):
    """Where the exact solution through the probe points has a negative cost, the fit is the non-negative
    costs that fit the points best, not one cost set to 0 and the next taking the rest: ZeRO-2's probe
    on the 2-core CPU (wide-point, docs/results/zoo_accuracy_2026-12-05.md) left 7.0 ms at 12 blocks 8 x 1 and 21.8
    at 4 x 2, and one after another its 8 x 1 candidates were priced 14.8 ms. A plan refits kept costs
    from their kept runs by the code as it is."""
    import random

    from analysis.plan import backend_costs as bc
    from analysis.plan import probe

    n, params = {2: 10, 12: 50, "wide": 52}, {2: 9_096, 12: 51_976, "wide": 210_568}
    left = {(2, 8, 1): 5.4e-3, (12, 8, 1): 7.0e-3, (12, 4, 2): 21.8e-3, bc.WIDE: 8.2e-3}
    size = {**{p: p[0] for p in bc.POINTS}, bc.WIDE: "wide"}

    def misfit(costs: dict) -> float:
        return sum((bc.cost_seconds(costs, p[2], n[size[p]], params[size[p]]) - r) ** 2 for p, r in left.items())

    fitted = bc.fit(left, n, params)
    assert all(v >= 0 for v in fitted.values())
    assert abs(bc.cost_seconds(fitted, 1, n[12], params[12]) - 7.0e-3) < 3.5e-3  # one after another: 14.8 ms
    rng = random.Random(0)
    for _ in range(200):  # no other non-negative costs fit the points better
        other = {k: max(0.0, v * rng.uniform(0.5, 1.5) + rng.choice([0.0, 1e-3 if k != "per_param_s" else 1e-9]))
                 for k, v in fitted.items()}
        assert misfit(other) >= misfit(fitted) - 1e-15
    # kept with figures fitted otherwise (a cache from before): priced as its runs fit now
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    runs = {bc.point_label(p): {"measured_s": [r + 0.02, r + 0.01, r + 0.01], "predicted_s": 0.01} for p, r in left.items()}
    kept = {"per_step_s": 0.0, "per_micro_step_s": 12.9e-3, "per_item_s": 3e-5, "per_param_s": 7.5e-9,
            "item": "trainable tensor", "runs": runs, "items": {str(k): v for k, v in n.items()},
            "params": {str(k): v for k, v in params.items()}, "machine": bc.machine()}
    (tmp_path / "backend_costs.json").write_text(json.dumps({bc.key("ds_configs/z2.json", 2): kept}))
    found, missing = probe.costs_for(["ds_configs/z2.json"], 2, None, measure_missing=False, progress=lambda line: None)
    assert not missing and found["ds_configs/z2.json"]["per_micro_step_s"] == pytest.approx(fitted["per_micro_step_s"])
    assert json.loads((tmp_path / "backend_costs.json").read_text())[bc.key("ds_configs/z2.json", 2)] == kept


def test_the_machine_the_costs_are_kept_for_names_the_cpus_generation():
    """Two CPUs /proc/cpuinfo names alike ("AMD EPYC", as virtual machines do) but of other families
    are other machines: costs kept on one are not priced on the other."""
    from core.environment import cpu_name

    def cpuinfo(family):
        one = f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 2\n" \
              "model name\t: AMD EPYC\nstepping\t: 1\n"
        return one + "\n" + one.replace("processor\t: 0", "processor\t: 1").replace(f": {family}", ": 99")

    assert cpu_name(cpuinfo(26)) == "AMD EPYC (cpu family 26, model 2, stepping 1)"  # the first processor's
    assert cpu_name(cpuinfo(25)) != cpu_name(cpuinfo(26))
    assert cpu_name("processor\t: 0\nmodel name\t: Some CPU\n") == "Some CPU"  # no ids: the name alone
    assert cpu_name("processor\t: 0\nBogoMIPS\t: 50.00\n") is None  # no name (some ARM kernels)
    assert cpu_name(cpuinfo(26), ids=False) == "AMD EPYC"  # a record's device_name: the name alone


def test_kept_costs_are_priced_at_the_machines_speed_now(tmp_path, monkeypatch):
    """Costs measured while the machine ran at one speed (its reference step, kept beside them) are
    scaled to the speed a plan reads when it prices them; costs kept without a reference stay as
    kept; the cache keeps what was measured, unscaled; the plan's assumption line says by how much."""
    from analysis.plan import backend_costs as bc
    from analysis.plan import probe

    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    truth = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 1e-4, "item": "trainable tensor"}
    speeds = iter([2e-3, 1e-3])  # measured at 2 ms a reference step; the plan reads 1 ms: twice as fast
    monkeypatch.setattr(probe, "reference_seconds", lambda: next(speeds))
    monkeypatch.setattr(probe, "measure", lambda config, world, device, progress=print, *protocol:
                        {**truth, "reference_s": probe.reference_seconds()})
    found, _ = probe.costs_for(["ddp"], 2, None, measure_missing=True, progress=lambda line: None)
    assert found["ddp"]["per_step_s"] == pytest.approx(0.002) and found["ddp"]["per_item_s"] == pytest.approx(5e-5)
    assert json.loads((tmp_path / "backend_costs.json").read_text())["ddp|world=2|"]["per_step_s"] == 0.004
    assert "x0.50" in bc.summary_line(found, [])
    speeds = iter([4e-3])  # kept, read at 4 ms now: twice as slow as when measured
    found, _ = probe.costs_for(["ddp"], 2, None, measure_missing=False, progress=lambda line: None)
    assert found["ddp"]["per_micro_step_s"] == pytest.approx(0.004) and "x2.00" in bc.summary_line(found, [])
    # benchmarks/own_costs_replay.py prices refitted costs at the speed the plan read, from its line
    from benchmarks.own_costs_replay import speed_now

    assert speed_now({"assumptions": ["overlap 0.5", bc.summary_line(found, [])]}) == pytest.approx(4e-3)
    assert speed_now({"assumptions": [bc.summary_line({"ddp": truth}, [])]}) is None
    assert bc.at_speed(truth, 4e-3) == truth  # kept without a reference: as kept
    scaled = bc.at_speed({**truth, "per_param_s": 1e-8, "reference_s": 2e-3}, 4e-3)
    assert scaled["per_param_s"] == pytest.approx(2e-8) and scaled["per_item_s"] == pytest.approx(2e-4)
    assert 0 < bc.reference_seconds() < 1  # the real one: a step of a tiny model, in seconds


def test_the_machines_speed_is_not_read_from_a_moment_something_else_ran():
    """The reference step that prices kept costs at the machine's speed now (backend_costs.
    reference_seconds) is the fastest of its batches' medians, taken apart in time: something else
    running through one batch (a ViT plan on 2026-11-29, its records lost with their session, read
    2.54 ms where the machine ran at about 1.1 and priced every configuration 2.3x too high)
    does not move it; the machine slowing down through all of them does."""
    from analysis.plan import backend_costs as bc

    steady = [[1.0e-3, 1.1e-3, 1.2e-3]] * bc.REFERENCE_BATCHES
    assert bc.steady_seconds(steady) == pytest.approx(1.1e-3)
    # through three batches of five: more than half the calls, their median 2.4 ms
    blip = [*[[2.4e-3, 2.6e-3, 2.5e-3]] * 3, *steady[3:]]
    assert bc.steady_seconds(blip) == pytest.approx(1.1e-3)
    slower = [[2 * t for t in b] for b in steady]
    assert bc.steady_seconds(slower) == pytest.approx(2.2e-3)
    assert bc.REFERENCE_BATCHES >= 3 and bc.REFERENCE_GAP_S > 0


def test_a_plan_prices_kept_costs_at_the_faster_of_its_two_reads_of_the_machines_speed(tmp_path, monkeypatch):
    """The plan reads the reference step before its calibration and again when it prices the kept
    costs (probe.costs_for's speed_before), and keeps the faster, as a probe run keeps the faster of
    its reads before and after: one read slowed by something else (the first plan of two evenings,
    trainable-comm, docs/results/zoo_accuracy_2026-12-05.md: 2.78 ms where the plans after read 1.64-1.75) does
    not price every configuration's own cost 1.6x too high; the machine slowing through both reads does."""
    from analysis.plan import backend_costs as bc
    from analysis.plan import probe

    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    kept = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 1e-4, "item": "trainable tensor",
            "reference_s": 2e-3, "machine": bc.machine()}
    (tmp_path / "backend_costs.json").write_text(json.dumps({bc.key("ddp", 2): kept}))

    def priced(now: float, before: float | None) -> float:
        monkeypatch.setattr(probe, "reference_seconds", lambda: now)
        found, _ = probe.costs_for(["ddp"], 2, None, measure_missing=False, progress=lambda line: None,
                                   speed_before=before)
        return found["ddp"]["per_step_s"]

    assert priced(3e-3, 1e-3) == pytest.approx(0.002)  # the read now slow, the one before fast: the faster
    assert priced(1e-3, 3e-3) == pytest.approx(0.002)
    assert priced(3e-3, 3e-3) == pytest.approx(0.006)  # both slow: the machine is
    assert priced(3e-3, None) == pytest.approx(0.006)  # no read before: this one


def test_a_probe_points_step_is_the_median_of_its_repeats():
    """A probe point's step is the median of its repeats (backend_costs.point_seconds, POINT_RULE): a run
    of the kind the plan is judged against (the grid's median of its rounds), so one slow repeat does not
    set the cost and one fast one does not either; "fastest", the rule before, stays for
    benchmarks/own_costs_replay.py --repeats fastest."""
    from analysis.plan import backend_costs as bc

    assert bc.POINT_RULE == "median"
    assert bc.point_seconds([0.170, 0.328, 0.676]) == 0.328
    assert bc.point_seconds([0.170, 0.328, 0.676], "fastest") == 0.170
    with pytest.raises(ValueError, match="median"):
        bc.point_seconds([0.1], "mean")
    truth = {"per_step_s": 0.004, "per_micro_step_s": 0.002, "per_item_s": 1e-4}
    tensors = {2: 10, 12: 50}
    runs = {}
    for slow, (layers, m, a) in zip((1, 2, 3), bc.POINTS):
        typical = 0.01 + bc.cost_seconds(truth, a, tensors[layers])  # predicted 0.01 s, plus the cost
        runs[f"{layers}x{m}x{a}"] = {"predicted_s": 0.01, "measured_s": [typical * (1 + slow), typical, typical * 0.9]}
    assert bc.fit_runs(runs, {"2": 10, "12": 50}) == pytest.approx(truth)
    assert bc.fit_runs(runs, {"2": 10, "12": 50}, rule="fastest") != pytest.approx(truth)  # the fast runs' costs
    # the wide point kept beside them (measure's names and keys since it was added)
    sized = {**truth, "per_param_s": 2e-8}
    n, params = {"2": 10, "12": 50, "wide": 52}, {"2": 9_000, "12": 52_000, "wide": 208_000}
    for point in (*bc.POINTS, bc.WIDE):
        size = "wide" if point == bc.WIDE else str(point[0])
        typical = 0.01 + bc.cost_seconds(sized, point[2], n[size], params[size])
        runs[bc.point_label(point)] = {"predicted_s": 0.01, "measured_s": [typical * 3, typical, typical * 0.99]}
    assert bc.point_label(bc.WIDE) == "12x8x1w128" and bc.point_label(bc.POINTS[0]) == "2x8x1"
    assert bc.fit_runs(runs, n, params) == pytest.approx(sized)
    fastest = bc.fit_runs(runs, n, params, "fastest")
    assert fastest != pytest.approx(sized) and sum(fastest.values()) < sum(sized.values())


def test_the_link_is_probed_once_per_machine_and_kept_with_the_backend_costs(tmp_path, monkeypatch):
    """--gpu here prices every call on the link kept in the backend costs' file (their residuals are
    what is left after pricing the probe runs' calls on it): probed the first time (many calls, several
    launches: five calls read 291 to 2381 us per ring step across eight plans on the 2-core CPU), then
    read back, probed again on another machine or world; a probe takes the mean of each launch's calls
    and the median of the launches; the tests' cache (os.devnull) keeps nothing."""
    from analysis.plan import backend_costs as bc
    from analysis.plan import device

    launches = iter([(0.004, 0.020), (0.001, 0.012), (0.002, 0.014)])  # (small, large) seconds per call

    class Queue:
        def get(self):
            return next(launches)

    class Proc:
        exitcode = 0

        def __init__(self, target, args):
            pass

        def start(self):
            pass

        def join(self, timeout):
            pass

    class Context:
        SimpleQueue = Queue
        Process = Proc

    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "get_context", lambda kind: Context())
    link = device.probe_link(2, sizes=(1024, 8 * 2**20), calls=(50, 8), launches=3)
    # the median launch's: 0.002 s over 2 ring steps; 8 MiB of bus bytes over (0.014 - 0.002) s
    assert link.latency_us == pytest.approx(1000.0) and link.gb_s == pytest.approx(8 * 2**20 / 0.012 / 1e9)

    probed = []

    def fake_probe(world):
        probed.append(world)
        return device.Link(1.5, 700.0 + len(probed), "probed")

    monkeypatch.setattr(device, "probe_link", fake_probe)
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    first = device.machine_link(2)
    assert (first.latency_us, probed) == (701.0, [2]) and str(tmp_path) in first.source
    assert device.machine_link(2).latency_us == 701.0 and probed == [2]  # kept: not probed again
    kept = json.loads((tmp_path / "backend_costs.json").read_text())
    assert kept["link|world=2"]["machine"] == bc.machine() and kept["link|world=2"]["gb_s"] == 1.5
    assert device.machine_link(4).latency_us == 702.0 and probed == [2, 4]
    monkeypatch.setattr(bc, "machine", lambda: {"cpu": "another"})
    assert device.machine_link(2).latency_us == 703.0 and probed == [2, 4, 2]
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", os.devnull)
    assert device.machine_link(2).latency_us == 704.0 and device.machine_link(2).latency_us == 705.0
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)


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
