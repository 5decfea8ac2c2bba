"""The planner's command line in this process (analysis/plan/cli.py, report.py): --out, the frontier,
bad input, and the calibration asked for the candidates' micro-batches."""

import json
import subprocess
import sys

import pytest

from analysis import plan
from analysis.plan import cli
from conftest import REPO, base_env

TINY = ["--preset", "tiny"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "analysis.plan", *args], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=300)


def _here(*args):
    """analysis.plan's main in this process: the logic (the CLI as a process: the test below)."""
    from conftest import in_process

    return in_process(plan.main, args)


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

    monkeypatch.setattr(cli, "here_device", here)
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
