"""One resolution for every tool that speaks about a run (simulation/describe.py): the configuration
analysis.estimate_cli, analysis.project and simulation.fake_world resolve from train.py's flags equals the
one `train.py --dry_run` prints for the same flags under a launcher of the same world."""

import json

import pytest

from conftest import REPO, dry_run, in_process

LLAMA = "num_hidden_layers=2,hidden_size=64,num_attention_heads=2,num_key_value_heads=2,intermediate_size=128"

# (train.py's flags, world): an FSDP file with --precision (the override train.py applies to the
# file's mixed precision), ZeRO-3 at another micro-batch, a user-facing HF model, DDP on the defaults,
# and a checkpointing plan made by --ckpt_policy auto.
CASES = {
    "fsdp-bf16": (["--fsdp_config", "fsdp_configs/shard_grad_op.yaml", "--precision", "bf16", "--preset", "tiny"], 2),
    "z3": (["--deepspeed_config", "ds_configs/z3.json", "--micro_batch", "2", "--preset", "tiny"], 2),
    "llama": (["--model", "hf:llama", "--model_args", LLAMA, "--ckpt_interval", "1", "--block_size", "32"], 1),
    "ddp-defaults": (["--backend", "ddp"], 2),
    "auto": (["--preset", "tiny", "--ckpt_policy", "auto", "--mem_budget_gb", "0.012", "--ckpt_cost", "counted"], 1),
}


@pytest.fixture(scope="module")
def dry_runs():
    return {name: dry_run(flags, world) for name, (flags, world) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimator_resolves_train_py_flags_as_train_py_does(case, dry_runs, capsys):
    """analysis.estimate_cli takes train.py's flags (names and defaults) and its `config` is the dry run's;
    the estimate itself is the estimate of that record (what the report gives the run)."""
    from estimator.estimate import estimate_from_record
    from analysis.estimate_cli import main

    flags, world = CASES[case]
    assert main(["--world", str(world), *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    config = out.pop("config")
    assert config.pop("environment")["device"] == "cpu"
    assert config == dry_runs[case]
    assert out["total_bytes"] == estimate_from_record({**config, "environment": {"device": "cpu"}}).total_bytes


def test_an_fsdp_file_is_estimated_at_the_precision_train_py_runs_it():
    """`--precision bf16` with an FSDP file: the run gathers bf16 parameters, and so does the estimate
    (it used to estimate the file's fp32)."""
    from estimator.estimate import estimate_from_record
    from simulation.describe import describe

    flags = ["--fsdp_config", "fsdp_configs/shard_grad_op.yaml", "--preset", "tiny"]
    fp32, bf16 = (estimate_from_record(describe([*flags, "--precision", p], world=2)) for p in ("fp32", "bf16"))
    assert bf16.params_gathered < fp32.params_gathered and bf16.activation_bytes < fp32.activation_bytes


def test_a_plan_the_estimator_prints_is_the_plan_train_py_runs(dry_runs, capsys):
    from analysis.estimate_cli import main

    flags, world = CASES["auto"]
    assert main([*flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert ",".join(out["ckpt_plan"]) == dry_runs["auto"]["run"]["ckpt_plan"]
    assert len(set(out["ckpt_plan"])) > 1  # a mixed plan: the budget sits between none's peak and full's


@pytest.mark.parametrize("entry", ["fsdp_configs/shard_grad_op.yaml", "ds_configs/z3.json", "ddp"])
def test_the_projection_resolves_each_configuration_as_train_py_does(entry):
    """analysis.project's run for a configuration is train.py's for the same flags plus that
    configuration's (its device aside: the projection's is a GPU)."""
    from analysis.project import resolve_entry, run_flags

    flags = ["--preset", "tiny", "--precision", "bf16", "--micro_batch", "2"]
    described = resolve_entry(entry, flags, 2, 2).record()
    expected = dry_run([*run_flags(entry, flags), "--device", "auto"], 2)
    assert described["run"].pop("device") == "cuda" and expected["run"].pop("device") == "auto"
    assert described == expected


@pytest.mark.parametrize("argv, message", [
    (["--world", "0"], "world must be an integer >= 1 (got 0)"),
    (["--micro_batch", "-4"], "micro_batch"),
    (["--deepspeed_config", "ds_configs/z3.json", "--fsdp_config", "fsdp_configs/fsdp2.yaml"], "fsdp_config"),
    (["--config", "ds_configs/z3.json"], "unrecognized arguments: --config"),
    (["--fsdp_config", "fsdp_configs/hybrid_shard.yaml", "--world", "2", "--gpus_per_node", "1"],
     "hybrid_shard_size 1 must be >= 2"),
    (["--ckpt_policy", "auto"], "mem_budget_gb"),
])
def test_the_estimator_refuses_what_train_py_refuses_in_one_line(argv, message):
    from analysis.estimate_cli import main

    proc = in_process(main, argv)  # the logic; tests/unit/test_trust.py runs the CLI's refusals as processes
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.distributed
def test_a_simulated_world_runs_the_configuration_train_py_resolves(dry_runs, tmp_path):
    """simulation.fake_world runs the flags as train.py resolves them: its run's settings and backend plan
    are the dry run's, but for the settings fake_world owns (steps, where it writes)."""
    owned = {"steps", "warmup_steps", "eval_batches", "quiet", "runs_dir", "run_name", "nvme_path", "dry_run"}
    cases = ("fsdp-bf16", "z3")
    (tmp_path / "cases.json").write_text(json.dumps([[CASES[c][1], 8, CASES[c][0]] for c in cases]))
    from conftest import python

    proc = python(REPO / "tests" / "support" / "fake_world_batch.py", tmp_path / "cases.json", tmp_path / "out.json",
                  timeout=600)  # simulation.fake_world.simulate, both in one process
    assert proc.returncode == 0, proc.stderr
    for case, result in zip(cases, json.loads((tmp_path / "out.json").read_text())):
        flags, world = CASES[case]
        expected = {k: v for k, v in dry_runs[case]["run"].items() if k not in owned}
        assert {k: v for k, v in result["run"].items() if k not in owned} == expected
        assert result["plan"] == dry_runs[case]["plan"]


_OPENED: list = []  # paths opened while a test below watches (an audit hook cannot be removed)
_WATCHING: list = []


def _watch(event, args):
    if _WATCHING and event == "open" and args and isinstance(args[0], (str, bytes)):
        _OPENED.append(str(args[0]))


@pytest.mark.parametrize("flags", [
    ["--save_every", "1"],
    ["--save_every", "1", "--resume", "--overwrite"],
    ["--ckpt_policy", "auto", "--mem_budget_gb", "1", "--save_every", "1"],
], ids=["save", "resume", "auto"])
def test_resolving_for_a_tool_touches_no_record_checkpoint_or_lock(tmp_path, flags):
    """What estimate, project, plan and fake_world resolve (a dry run) never opens, locks or creates anything
    in the runs directory or the checkpoint directory it names, whoever owns them (issue 41)."""
    import sys

    from simulation.describe import resolve_flags

    runs, ck = tmp_path / "runs", tmp_path / "ck"
    # a finished run someone else owns: its config, per-step metrics and summary
    (runs / "r").mkdir(parents=True)
    (runs / "r" / "config.json").write_text(json.dumps({"preset": "tiny", "backend": "ddp", "world_size": 2}))
    (runs / "r" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 4.2}) + "\n")
    (runs / "r" / "summary.json").write_text(json.dumps({"status": "ok", "steps": 1}))
    (ck / "step_00000001").mkdir(parents=True)
    (ck / "step_00000001" / "meta.json").write_text('{"step": 1}')
    (ck / "latest").write_text("step_00000001\n")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    if _watch not in _WATCHING:
        sys.addaudithook(_watch)
    _OPENED.clear()
    _WATCHING.append(_watch)
    try:
        resolve_flags(["--preset", "tiny", "--backend", "ddp", "--runs_dir", str(runs), "--run_name", "r", "--save_dir",
                       str(ck), *flags], 2)
    finally:
        _WATCHING.clear()
    assert [p for p in _OPENED if p.startswith(str(tmp_path))] == []
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
