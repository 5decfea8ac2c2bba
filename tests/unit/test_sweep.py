"""sweep.py: specs, the runner, failures, timeouts, reruns.

The runner's own behaviour (records, keys, locks, failures, timeouts, retries, stopping) is tested
with tests/support/stub_run.py as each run's command, a stand-in without torch; one sweep launches train.py
for real, end to end (test_a_sweep_compares_models_and_the_report_says_which), and sweep.py's
answers to bad input are checked in this process, one of them as a process."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, base_env, in_process
from models.spec import parse_model_args
from stub_sweep import stub_command
from orchestration.sweep import expand, load_spec

SWEEP = REPO / "sweep.py"


def _spec(tmp_path, **spec) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "runs_dir": str(tmp_path / "runs"), **spec}))
    return str(path)


def _sweep(*args, timeout=900):
    return subprocess.run([sys.executable, str(SWEEP), *args], cwd=REPO, env=base_env(), capture_output=True,
                          text=True, timeout=timeout)


def _sweep_here(*args, timeout=None):
    """sweep.py's main in this process (the runs it launches are still processes)."""
    import sweep

    return in_process(sweep.main, args)


@pytest.fixture
def stubbed(monkeypatch):
    """Every run the sweep launches is tests/support/stub_run.py (the runner's behaviour, no launch per run)."""
    from orchestration.sweep import SweepRun

    monkeypatch.setattr(SweepRun, "command", stub_command)


def test_expansion_rules(tmp_path):
    spec = load_spec(_spec(tmp_path, matrix={
        "backend": ["single", "ddp", "fsdp_configs/full_shard.yaml", "ds_configs/z3.json"],
        "ckpt_interval": [0, 2], "ckpt_impl": ["torch_reentrant", "deepspeed"], "world_size": [2]}))
    runs, skipped = expand(spec)
    names = {r.name for r in runs}
    # single runs in one process; ckpt_impl only matters with checkpointing; deepspeed's impls
    # only under DeepSpeed.
    assert "single-w1-tiny-mb8x2-fp32-ckpt0" in names and not any(n.startswith("single-w2") for n in names)
    assert sum(n.endswith("ckpt0") for n in names) == 4
    assert "deepspeed.z3-w2-tiny-mb8-fp32-ckpt2-deepspeed" in names
    assert not any(n.startswith("ddp") and n.endswith("-deepspeed") for n in names)
    assert len(runs) == 4 + 4 + 1 and len(skipped) == 3
    command = next(r for r in runs if r.backend == "deepspeed").command(spec.directory)
    assert command[0].endswith("deepspeed") and "--num_gpus" in command and "--master_port" in command


def test_single_trains_on_the_global_batch_of_the_ranks_it_is_compared_to(tmp_path):
    """One process accumulates over the matrix's ranks (a spec's own grad_accum too): the same global batch,
    so the same samples step by step, as the runs of that world size; at world 1 it runs as given."""
    spec = load_spec(_spec(tmp_path, matrix={"backend": ["single", "ddp"], "world_size": [1, 2, 4]},
                           train_args={"grad_accum": 2}))
    runs = {r.name: r for r in expand(spec)[0]}
    global_batch = {name: r.world_size * dict(r.flags)["micro_batch"] * dict(r.flags)["grad_accum"]
                    for name, r in runs.items()}
    assert global_batch == {"single-w1-tiny-mb8-fp32-ckpt0": 16, "single-w1-tiny-mb8x4-fp32-ckpt0": 32,
                            "single-w1-tiny-mb8x8-fp32-ckpt0": 64, "ddp-w1-tiny-mb8-fp32-ckpt0": 16,
                            "ddp-w2-tiny-mb8-fp32-ckpt0": 32, "ddp-w4-tiny-mb8-fp32-ckpt0": 64}
    assert all(r.world_size == 1 for name, r in runs.items() if name.startswith("single"))
    argv = runs["single-w1-tiny-mb8x4-fp32-ckpt0"].argv(tmp_path)
    assert argv.count("--grad_accum") == 1 and argv[argv.index("--grad_accum") + 1] == "4"
    # The largest-batch search groups each single run apart (its key says the accumulation).
    assert len({r.config_key for r in runs.values()}) == len(runs)


def test_activation_offload_dimension(tmp_path):
    spec = load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "ckpt_interval": [0, 1],
                                             "activation_offload": ["none", "torch", "prefetch2"]}))
    runs = {r.name: dict(r.flags) for r in expand(spec)[0]}
    # Nothing checkpointed, nothing to offload: one run without checkpointing, three with.
    assert sorted(runs) == ["ddp-w2-tiny-mb8-fp32-ckpt0", "ddp-w2-tiny-mb8-fp32-ckpt1-torch_nonreentrant",
                            "ddp-w2-tiny-mb8-fp32-ckpt1-torch_nonreentrant-offload_prefetch2",
                            "ddp-w2-tiny-mb8-fp32-ckpt1-torch_nonreentrant-offload_torch"]
    assert runs["ddp-w2-tiny-mb8-fp32-ckpt1-torch_nonreentrant-offload_torch"]["ckpt_offload"] is True
    prefetch = runs["ddp-w2-tiny-mb8-fp32-ckpt1-torch_nonreentrant-offload_prefetch2"]
    assert prefetch["offload_activations"] is True and prefetch["activation_loading_horizon"] == 2
    assert not {"ckpt_offload", "offload_activations"} & set(runs["ddp-w2-tiny-mb8-fp32-ckpt0"])


def test_compile_dimension(tmp_path):
    spec = load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "compile": ["none", "aot_eager"]}))
    runs = {r.name: r for r in expand(spec)[0]}
    assert sorted(runs) == ["ddp-w2-tiny-mb8-fp32-ckpt0", "ddp-w2-tiny-mb8-fp32-ckpt0-compile_aot_eager"]
    compiled = runs["ddp-w2-tiny-mb8-fp32-ckpt0-compile_aot_eager"].argv(tmp_path)
    assert "--compile" in compiled and compiled[compiled.index("--compile_backend") + 1] == "aot_eager"
    assert "--compile" not in runs["ddp-w2-tiny-mb8-fp32-ckpt0"].argv(tmp_path)
    with pytest.raises(Exception, match="matrix.compile values must be among none, inductor"):
        load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "compile": ["tvm"]}))


def test_model_dimension(tmp_path):
    spec = load_spec(_spec(tmp_path, matrix={
        "backend": ["ddp"], "preset": ["tiny", "small"],
        "model": ["gptlite", {"model": "hf:resnet", "args": {"layer_type": "basic", "depths": [2, 2, 2, 2]},
                              "label": "resnet18"}, "examples/my_model.py"]}))
    runs = {r.name: r for r in expand(spec)[0]}
    # The presets size GPT-lite; another model runs once, named by its label.
    assert sorted(runs) == ["ddp-w2-my_model-mb8-fp32-ckpt0", "ddp-w2-resnet18-mb8-fp32-ckpt0",
                            "ddp-w2-small-mb8-fp32-ckpt0", "ddp-w2-tiny-mb8-fp32-ckpt0"]
    argv = runs["ddp-w2-resnet18-mb8-fp32-ckpt0"].argv(tmp_path)
    assert argv[argv.index("--model") + 1] == "hf:resnet"
    assert parse_model_args(argv[argv.index("--model_args") + 1]) == {"layer_type": "basic", "depths": [2, 2, 2, 2]}
    assert "--model" not in runs["ddp-w2-tiny-mb8-fp32-ckpt0"].argv(tmp_path)
    assert "model_file_sha256" in runs["ddp-w2-my_model-mb8-fp32-ckpt0"].key()  # an edited file is a new run
    for bad, message in (([{"model": "hf:gpt2", "flavour": 1}], "matrix.model entries must be"),
                         (["hf:gpt2", "hf:gpt2"], "same label"), (["hf:"], "needs a model type")):
        with pytest.raises(Exception, match=message):
            load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "model": bad}))


@pytest.mark.launch
def test_a_sweep_compares_models_and_the_report_says_which(tmp_path):
    """The one real sweep: sweep.py launching train.py (plain python) for each run, end to end."""
    path = _spec(tmp_path, steps=3, matrix={
        "backend": ["single"], "model": ["gptlite", {"model": "examples/my_model.py", "args": {"width": 32},
                                                     "label": "mlp"}]},
        train_args={"warmup_steps": 1, "mem_profile_steps": 1, "eval_batches": 1})
    proc = _sweep(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "report"
    from analysis import report as report_cli

    report = in_process(report_cli.main, [tmp_path / "runs", "--out", out])
    assert report.returncode == 0, report.stderr
    runs_table = (out / "report.md").read_text().split("## Runs", 1)[1].split("##", 1)[0]
    assert "| model " in runs_table and "my_model width=32" in runs_table and "gptlite" in runs_table


@pytest.mark.launch
def test_a_sweep_records_a_failure_goes_on_and_a_rerun_skips_what_is_done(tmp_path, stubbed):
    spec = _spec(tmp_path, steps=3, matrix={"backend": ["single", "ddp", "fsdp_configs/full_shard.yaml"],
                                            "micro_batch": [2], "world_size": [2]},
                 train_args={"warmup_steps": 1, "mem_profile_steps": 0, "eval_batches": 1},
                 env={"GPTLITE_FAULT": "kind=error,step=1,rank=1,backend=ddp"})
    first = _sweep_here(spec)
    assert first.returncode == 1, first.stderr  # the sweep went on, and says that a run failed
    runs = tmp_path / "runs"
    summaries = {p.parent.name: json.loads(p.read_text()) for p in runs.glob("*/summary.json")}
    assert {name: s["status"] for name, s in summaries.items()} == {
        "single-w1-tiny-mb2x2-fp32-ckpt0": "ok", "ddp-w2-tiny-mb2-fp32-ckpt0": "failed",
        "fsdp.full_shard-w2-tiny-mb2-fp32-ckpt0": "ok"}
    assert "injected fault" in summaries["ddp-w2-tiny-mb2-fp32-ckpt0"]["error"]
    assert "1 failed, 2 ok" in first.stdout
    assert (runs / ".logs" / "ddp-w2-tiny-mb2-fp32-ckpt0.log").stat().st_size > 0

    before = {p: p.stat().st_mtime_ns for p in runs.glob("*/summary.json")}
    again = _sweep_here(spec)
    assert again.stdout.count("(already done)") == 3
    assert before == {p: p.stat().st_mtime_ns for p in runs.glob("*/summary.json")}
    # --json: one object on stdout, the runs as recorded; every other line on stderr
    as_json = _sweep_here(spec, "--json")
    result = json.loads(as_json.stdout)
    assert {r["name"]: r["status"] for r in result["runs"]} == {name: s["status"] for name, s in summaries.items()}
    assert result["counts"] == {"ok": 2, "failed": 1} and as_json.stderr.count("(already done)") == 3
    planned = json.loads(_sweep_here(spec, "--dry_run", "--json").stdout)
    assert [r["name"] for r in planned["runs"]] == [r["name"] for r in result["runs"]]
    assert all(r["name"] in r["command"] for r in planned["runs"])  # its command names its record

    retried = _sweep_here(spec, "--retry_failed")
    assert retried.stdout.count("(already done)") == 2 and "ddp-w2-tiny-mb2-fp32-ckpt0: failed" in retried.stdout


@pytest.mark.launch
def test_orchestration_runs_one_run_and_a_sweep_of_runs_through_its_public_functions(tmp_path, stubbed):
    """orchestration.run_one (the planner's one call per candidate) launches a run and waits for it, and
    reuses its record when asked again; run_many runs several in order as one sweep holding the folder,
    a failing one recorded as failed and the next still run."""
    import orchestration
    from orchestration import SweepRun, run_many, run_one

    flags = (("preset", "tiny"), ("steps", 2), ("micro_batch", 2))
    run = SweepRun("one", "single", None, 1, flags)
    first = run_one(run, tmp_path / "a", 600)
    assert first.status == "ok" and not first.skipped, first.line()
    assert json.loads((tmp_path / "a" / "one" / "summary.json").read_text())["status"] == "ok"
    again = run_one(run, tmp_path / "a", 600)
    assert again.status == "ok" and again.skipped  # the same run's record, reused, not rerun

    failing = SweepRun("two", "single", None, 1, flags, env=(("GPTLITE_FAULT", "kind=error,step=1"),))
    lines = []
    outcomes = run_many("s", tmp_path / "b", 600, [failing, SweepRun("three", "single", None, 1, flags)],
                        report=lines.append)
    assert [(o.run.name, o.status) for o in outcomes] == [("two", "failed"), ("three", "ok")]
    assert any("two: failed" in line for line in lines)
    assert orchestration.executor_for is orchestration.executors.executor_for  # one interface, not a copy


@pytest.mark.launch
def test_a_run_past_its_timeout_is_killed_and_recorded(tmp_path, stubbed):
    spec = _spec(tmp_path, steps=3, timeout_s=3, matrix={"backend": ["ddp"], "micro_batch": [2], "world_size": [2]},
                 train_args={"mem_profile_steps": 0}, env={"GPTLITE_FAULT": "kind=hang,step=1"})
    proc = _sweep_here(spec)
    assert proc.returncode == 1, proc.stderr
    summary = json.loads((tmp_path / "runs" / "ddp-w2-tiny-mb2-fp32-ckpt0" / "summary.json").read_text())
    assert summary["status"] == "timeout" and "timed out after 3 s" in summary["error"]
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "runs")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""  # the launcher and both ranks are gone


@pytest.mark.distributed
def test_a_forked_run_past_its_timeout_is_killed_with_every_rank(tmp_path, forked_launchers):
    """The fork launcher as the in-process sweeps use it (conftest.forked_runs: no launcher process,
    the ranks in a process group of their own): the runner's timeout reaches both train.py ranks."""
    from pathlib import Path

    log = Path(os.environ["GPTLITE_TEST_LAUNCH_LOG"])
    seen = len(log.read_bytes().splitlines())
    spec = _spec(tmp_path, steps=3, timeout_s=6, matrix={"backend": ["ddp"], "micro_batch": [2], "world_size": [2]},
                 train_args={"mem_profile_steps": 0, "warmup_steps": 0, "eval_batches": 1},
                 env={"GPTLITE_FAULT": "kind=hang,step=1"})
    proc = _sweep_here(spec)
    assert proc.returncode == 1, proc.stderr
    summary = json.loads((tmp_path / "runs" / "ddp-w2-tiny-mb2-fp32-ckpt0" / "summary.json").read_text())
    assert summary["status"] == "timeout" and "timed out after 6 s" in summary["error"]
    ranks = [int(line.split()[0]) for line in log.read_bytes().splitlines()[seen:]
             if b" [fork] " in line and str(tmp_path).encode() in line]
    assert len(ranks) == 2, ranks
    for pid in ranks:  # ended and reaped: no process of that pid (nothing else reuses it this soon)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.launch
def test_a_changed_spec_never_reuses_or_overwrites_a_record(tmp_path, stubbed):
    """The key of a record includes every setting: after `steps` changes, the old record is
    neither taken as done nor overwritten; the sweep refuses before running anything."""
    args = dict(matrix={"backend": ["single"], "micro_batch": [2]},
                train_args={"warmup_steps": 0, "mem_profile_steps": 0, "eval_batches": 1})
    first = _sweep_here(_spec(tmp_path, steps=2, **args))
    assert first.returncode == 0, first.stderr
    summary = tmp_path / "runs" / "single-w1-tiny-mb2x2-fp32-ckpt0" / "summary.json"
    before = summary.read_bytes()
    changed = _sweep_here(_spec(tmp_path, steps=3, **args))
    assert changed.returncode == 2 and "recorded with other settings" in changed.stderr
    assert "--steps '2' then, '3' now" in changed.stderr and len(changed.stderr.strip().splitlines()) == 1
    assert summary.read_bytes() == before


@pytest.mark.launch
def test_stopping_the_sweep_stops_its_run_and_records_it(tmp_path):
    import signal
    import time

    spec = _spec(tmp_path, steps=100000, matrix={"backend": ["ddp"], "micro_batch": [2], "world_size": [2]},
                 train_args={"mem_profile_steps": 0})
    sweep = subprocess.Popen([sys.executable, str(REPO / "tests" / "support" / "stub_sweep.py"), spec], cwd=REPO, env=base_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    summary = tmp_path / "runs" / "ddp-w2-tiny-mb2-fp32-ckpt0" / "summary.json"
    deadline = time.monotonic() + 120
    while not (summary.exists() and "running" in summary.read_text()) and time.monotonic() < deadline:
        time.sleep(0.5)
    sweep.send_signal(signal.SIGTERM)
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 143, err
    assert json.loads(summary.read_text())["status"] == "failed"
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "runs")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""  # launcher and ranks stopped with the sweep


@pytest.mark.parametrize("spec, message", [
    pytest.param({"matrix": {"backend": ["ddp"]}}, "missing key 'name'", marks=pytest.mark.launch),
    ({"name": "t"}, "missing key 'matrix'"),
    ({"name": "t", "matrix": {"preset": ["tiny"]}}, "missing key 'matrix.backend'"),
    ({"name": "t", "matrix": {"backend": ["ddp"]}, "train_args": {"lr": -1}}, "lr must be > 0"),
    ({"name": "t", "matrix": {"backend": ["ddp"]}, "train_args": {"dropout": "lots"}}, "dropout"),
    ({"name": "t", "matrix": {"backend": ["single"], "world_size": [2], "micro_batch": [0]}}, "micro_batch"),
    ({"name": "t", "matrix": {"backend": ["{bad}"]}}, "hybrid_shard_size"),
    # two files of one name: their runs would have one name, and one of them would never run
    ({"name": "t", "matrix": {"backend": ["ds_configs/z2.json", "{copy}"]}},
     "matrix.backend: 'ds_configs/z2.json' and '{copy}' would both name their runs deepspeed.z2-...; list a "
     "configuration once, or give the file another name"),
])
def test_a_bad_spec_is_refused_before_any_run(tmp_path, spec, message):
    if spec.get("matrix", {}).get("backend") == ["{bad}"]:
        bad = tmp_path / "hybrid.yaml"
        bad.write_text("backend: fsdp\nsharding_strategy: HYBRID_SHARD\nhybrid_shard_size: 3\n")
        spec["matrix"]["backend"] = [str(bad)]
    if "{copy}" in spec.get("matrix", {}).get("backend", []):
        copy = tmp_path / "z2.json"
        copy.write_text((REPO / "ds_configs" / "z2.json").read_text())
        spec["matrix"]["backend"] = ["ds_configs/z2.json", str(copy)]
        message = message.replace("{copy}", str(copy))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"runs_dir": str(tmp_path / "runs"), **spec}))
    proc = (_sweep if message == "missing key 'name'" else _sweep_here)(str(path))  # one as a process
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*/summary.json"))


@pytest.mark.parametrize("flags, message", [
    (("--max_batch", "--mem_budget_gb", "0"), "--mem_budget_gb must be a finite number > 0"),
    (("--max_batch", "--mem_budget_gb", "1", "--probe_steps", "0"), "--probe_steps must be >= 1"),
    (("--max_batch", "--mem_budget_gb", "1", "--max_micro_batch", "0"), "--max_micro_batch must be >= 1"),
])
def test_bad_max_batch_flags_are_refused(tmp_path, flags, message):
    proc = _sweep_here(_spec(tmp_path, matrix={"backend": ["single"]}), *flags)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


GOOD_DATASET = ("import torch\ndef get_dataset():\n"
                "    return torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))\n")
MODEL_FILES = {"{syntax}": "def get_model(:\n",
               "{raising}": GOOD_DATASET + "def get_model():\n    raise RuntimeError('no weights here')\n",
               "{plain}": GOOD_DATASET + "def get_model():\n    return torch.nn.Linear(4, 2)\n"}


@pytest.mark.parametrize("model, train_args, message", [
    ("hf:gtp2", {}, "not a transformers model type"),
    ("{missing}", {}, "file not found"),
    ({"model": "hf:gpt2", "args": {"n_layr": 2}}, {}, "has no setting n_layr"),
    ({"model": "examples/my_model.py", "args": {"widht": 8}}, {}, "does not take them"),
    ("{syntax}", {}, "SyntaxError"),
    ("{raising}", {}, "RuntimeError: no weights here"),
    ("examples/my_model.py", {"block_class": "Blokc"}, "block_class Blokc"),
    # sweeps/README.md's template sets dropout for every run: a model file takes none (case 21).
    ("examples/my_model.py", {"dropout": 0.0}, "dropout applies to gptlite and hf: models"),
])
def test_every_model_of_a_matrix_is_resolved_before_the_first_run(tmp_path, model, train_args, message):
    from gptlite.errors import ConfigError
    from orchestration.checks import check_runs

    if isinstance(model, str) and model in MODEL_FILES:
        (tmp_path / "bad_model.py").write_text(MODEL_FILES[model])
        model = str(tmp_path / "bad_model.py")
    elif model == "{missing}":
        model = str(tmp_path / "missing.py")
    spec = load_spec(_spec(tmp_path, matrix={"backend": ["single", "ddp"], "model": ["gptlite", model]},
                           train_args=train_args))
    runs, _ = expand(spec)
    with pytest.raises(ConfigError, match=f"^run [^ ]+: .*{message}") as refused:
        check_runs(runs, spec.directory)
    assert "\n" not in str(refused.value)


def test_a_model_without_blocks_is_refused_for_the_runs_that_need_them(tmp_path):
    """single and ddp train a model without a repeated block; a sweep that also puts it under FSDP is
    refused whole, naming that run (case 11)."""
    from gptlite.errors import ConfigError
    from orchestration.checks import check_runs

    (tmp_path / "plain.py").write_text(MODEL_FILES["{plain}"])
    spec = load_spec(_spec(tmp_path, matrix={"backend": ["single", "ddp"], "model": [str(tmp_path / "plain.py")]}))
    check_runs(expand(spec)[0], spec.directory)
    spec = load_spec(_spec(tmp_path, matrix={"backend": ["ddp", "fsdp"], "model": [str(tmp_path / "plain.py")]}))
    with pytest.raises(ConfigError, match=r"^run fsdp-\S+: the model \(Linear\) has no repeated block .*which backend "
                                          "fsdp needs"):
        check_runs(expand(spec)[0], spec.directory)


def test_each_distinct_model_is_resolved_once(tmp_path, monkeypatch):
    import training.run
    from orchestration.checks import check_runs

    seen, blocks = [], set()
    monkeypatch.setattr(training.run, "check_model", lambda cfg: seen.append((cfg.model, cfg.model_args)) or cfg.model)
    # The blocks, though, for every run: whether they are needed depends on its backend and flags.
    monkeypatch.setattr(training.run, "check_blocks", lambda workload, cfg: blocks.add((workload, cfg.ckpt_interval)))
    spec = load_spec(_spec(tmp_path, matrix={
        "backend": ["single", "ddp"], "micro_batch": [2, 4], "ckpt_interval": [0, 1],
        "model": ["gptlite", {"model": "examples/my_model.py", "args": "width=8"}]}))
    runs, _ = expand(spec)
    check_runs(runs, spec.directory)
    assert len(runs) == 16 and sorted(seen, key=str) == [("examples/my_model.py", "width=8"), ("gptlite", None)]
    assert blocks == {(m, c) for m in ("gptlite", "examples/my_model.py") for c in (0, 1)}


def test_a_dry_run_refuses_a_spec_a_model_cannot_run(tmp_path):
    path = _spec(tmp_path, matrix={"backend": ["single"], "model": ["examples/my_model.py"]},
                 train_args={"dropout": 0.0})
    proc = _sweep_here(path, "--dry_run")
    assert proc.returncode == 2 and "dropout applies to gptlite and hf: models" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_gptlite_args_in_a_matrix_are_applied_or_refused(tmp_path):
    from training.cli import config_from_argv

    spec = load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "preset": ["tiny", "small"], "model": [
        "gptlite", {"model": "gptlite", "args": {"n_layer": 2, "n_embd": 96}, "label": "shallow"}]}))
    runs = {r.name: r for r in expand(spec)[0]}
    assert sorted(runs) == ["ddp-w2-shallow.small-mb8-fp32-ckpt0", "ddp-w2-shallow.tiny-mb8-fp32-ckpt0",
                            "ddp-w2-small-mb8-fp32-ckpt0", "ddp-w2-tiny-mb8-fp32-ckpt0"]
    shallow = config_from_argv(runs["ddp-w2-shallow.small-mb8-fp32-ckpt0"].argv(tmp_path)).model_config()
    plain = config_from_argv(runs["ddp-w2-small-mb8-fp32-ckpt0"].argv(tmp_path)).model_config()
    assert (shallow.n_layer, shallow.n_embd) == (2, 96) and (plain.n_layer, plain.n_embd) == (6, 192)
    assert shallow.n_head == plain.n_head  # the rest from the preset
    labelled = load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "model": [{"model": "gptlite", "label": "base"}]}))
    assert [r.name for r in expand(labelled)[0]] == ["ddp-w2-base.tiny-mb8-fp32-ckpt0"]  # the label is used too
    for args, train_args, message in (({"hidden_size": 64}, {}, "gptlite's args are train.py's GPT-lite flags"),
                                      ({"n_layer": 2}, {"n_layer": 3}, "'n_layer' is also in matrix.model's args")):
        with pytest.raises(Exception, match=message):
            load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "model": [{"model": "gptlite", "args": args}]},
                            train_args=train_args))


def _planned(tmp_path, **train_args):
    spec = load_spec(_spec(tmp_path, steps=2, matrix={"backend": ["single"], "micro_batch": [2]},
                           train_args={"warmup_steps": 0, "mem_profile_steps": 0, "eval_batches": 1, **train_args}))
    (run,) = expand(spec)[0]
    return run


def _record(directory, planned, status, config=True, key=None):
    """A record as a run leaves it, with its key."""
    from core.records import SWEEP_KEY_FILE, atomic_write_json
    from core.summary import RunSummary

    record = directory / planned.name
    atomic_write_json(record / "summary.json", RunSummary(planned.name, status).to_dict())
    if config:
        atomic_write_json(record / "config.json", {"run": {"steps": 2}})
    atomic_write_json(record / SWEEP_KEY_FILE, key if key is not None else planned.key())
    atomic_write_json(directory / ".keys" / f"{planned.name}.json", key if key is not None else planned.key())
    return record


def _snapshot(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file() and ".locks" not in p.parts}


@pytest.mark.parametrize("state", ["running", "not created yet"])
def test_a_run_another_process_holds_is_left_alone(tmp_path, state):
    """Another sweep's run holds the record's lock (before or after creating its record): the
    runner launches nothing, writes no key, no log and no summary, and says so."""
    from training.locks import RecordLock
    from orchestration.runner import Runner

    runs = tmp_path / "runs"
    planned = _planned(tmp_path)
    if state == "running":
        _record(runs, planned, "running")
    holder = RecordLock(str(runs), planned.name)  # this test process is the other writer
    before = _snapshot(runs)
    outcome = Runner(runs, timeout_s=120).run(planned)
    holder.release()
    assert outcome.status == "left alone" and f"pid {os.getpid()}" in outcome.line()
    assert _snapshot(runs) == before and not (runs / ".logs").exists()


def test_a_record_of_a_run_that_never_got_going_does_not_pin_its_name(tmp_path):
    """A corrected spec replaces the record of a run that was refused or failed before it wrote its
    config; a record of other settings that trained (ok, or failed after starting) stays refused."""
    from gptlite.errors import ConfigError
    from orchestration.runner import Runner

    runs = tmp_path / "runs"
    old, corrected = _planned(tmp_path, lr=0.5), _planned(tmp_path)
    runner = Runner(runs, timeout_s=120)
    for status in ("failed", "timeout"):
        _record(runs, corrected, status, config=False, key=old.key())
        runner.check_records([corrected])
    for status in ("ok", "failed"):
        _record(runs, corrected, status, key=old.key())
        with pytest.raises(ConfigError, match="recorded with other settings"):
            runner.check_records([corrected])


def test_status_applies_the_rule_running_applies(tmp_path):
    """A record of its name made by another spec (steps 25, then 3: issue 39, case 6) was reported ok by
    --status while running refused it: --status now says other settings, and leaves it as it is."""
    from orchestration.slurm import SlurmSettings, SlurmSweep

    runs = tmp_path / "runs"
    mine, other = _planned(tmp_path), _planned(tmp_path, lr=0.5)
    _record(runs, mine, "ok", key=other.key())
    before = _snapshot(runs)
    (row,) = SlurmSweep("s", runs, 120, [mine], SlurmSettings()).status()
    assert row[1] == "other settings" and "lr" in row[3], row
    assert _snapshot(runs) == before
    _record(runs, mine, "ok")  # its own: ok
    assert SlurmSweep("s", runs, 120, [mine], SlurmSettings()).status()[0][1] == "ok"


def test_one_sweep_per_directory(tmp_path):
    """A second sweep into a directory a sweep holds is refused in one line naming the holder,
    before anything runs (whichever spec it is)."""
    from training.locks import FileLock

    path = _spec(tmp_path, steps=1, matrix={"backend": ["single"], "micro_batch": [2]},
                 train_args={"warmup_steps": 0, "mem_profile_steps": 0, "eval_batches": 1})
    holder = FileLock(tmp_path / "runs" / ".sweep.lock")  # this test process is the first sweep
    proc = _sweep_here(path)  # its own open of the lock file: flock refuses it as it would another process
    holder.release()
    assert proc.returncode == 2 and f"in use by another sweep (pid {os.getpid()})" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [".sweep.lock"]


@pytest.mark.launch
def test_a_refused_run_is_recorded_with_its_key_and_a_corrected_spec_replaces_it(tmp_path, stubbed):
    """The runner records a run train.py refused (with the run's key, never a record that is not
    its own); a corrected spec then runs in its place; a run's key is written by the run itself."""
    from core.records import SWEEP_KEY_FILE
    from orchestration.runner import Runner

    runs = tmp_path / "runs"
    runner = Runner(runs, timeout_s=300)
    bad = _planned(tmp_path, lr=-1.0)  # train.py refuses it: exit 2, nothing recorded by the run
    refused = runner.run(bad)
    assert refused.status == "failed" and "lr must be > 0" in refused.summary.error
    assert json.loads((runs / bad.name / SWEEP_KEY_FILE).read_text()) == bad.key()
    corrected = _planned(tmp_path)
    runner.check_records([corrected])
    outcome = runner.run(corrected)
    assert outcome.status == "ok" and not outcome.skipped, outcome.line()
    assert json.loads((runs / corrected.name / SWEEP_KEY_FILE).read_text()) == corrected.key()
    assert (runs / corrected.name / "config.json").exists() and not (runs / ".keys").exists()
    assert runner.run(corrected).skipped  # and it is now done


def test_ckpt_policy_dimension(tmp_path):
    """full and selective apply to the blocks ckpt_interval picks; auto:<GiB> plans every block, with
    interval 0 only; selective is left out under ZeRO-3, said; auto is not."""
    spec = load_spec(_spec(tmp_path, matrix={"backend": ["ddp", "ds_configs/z3.json"], "ckpt_interval": [0, 1],
                                             "ckpt_policy": ["full", "selective", "auto:0.2"]}))
    runs, skipped = expand(spec)
    flags = {r.name: dict(r.flags) for r in runs}
    assert sorted(n for n in flags if n.startswith("ddp")) == [
        "ddp-w2-tiny-mb8-fp32-auto0.2", "ddp-w2-tiny-mb8-fp32-ckpt0", "ddp-w2-tiny-mb8-fp32-ckpt1-torch_nonreentrant",
        "ddp-w2-tiny-mb8-fp32-ckpt1-torch_nonreentrant-selective"]
    assert flags["ddp-w2-tiny-mb8-fp32-auto0.2"]["ckpt_policy"] == "auto"
    assert flags["ddp-w2-tiny-mb8-fp32-auto0.2"]["mem_budget_gb"] == 0.2
    assert flags["ddp-w2-tiny-mb8-fp32-auto0.2"]["ckpt_interval"] == 0
    assert flags["ddp-w2-tiny-mb8-fp32-ckpt1-torch_nonreentrant-selective"]["ckpt_policy"] == "selective"
    assert "ckpt_policy" not in flags["ddp-w2-tiny-mb8-fp32-ckpt1-torch_nonreentrant"]
    assert "deepspeed.z3-w2-tiny-mb8-fp32-auto0.2" in flags
    assert not any(n.startswith("deepspeed.z3") and n.endswith("selective") for n in flags)
    assert skipped == ["deepspeed.z3 with ckpt_policy selective: refused under ZeRO-3 (wrong gradients)"]
    for bad in ("partial", "auto:", "auto:-1", "auto:x"):
        with pytest.raises(Exception, match="matrix.ckpt_policy values must be full, selective or auto:<GiB>"):
            load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "ckpt_policy": [bad]}))
    with pytest.raises(Exception, match="'mem_budget_gb' is also set by matrix.ckpt_policy"):
        load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "ckpt_policy": ["auto:1"]},
                        train_args={"mem_budget_gb": 2}))


def test_a_largest_batch_search_of_budget_plans_is_refused(tmp_path):
    """--max_batch's budget would replace the one an auto:<GiB> plan is made for: refused in one line."""
    proc = _sweep_here(_spec(tmp_path, matrix={"backend": ["single"], "ckpt_policy": ["auto:0.2"]}), "--max_batch",
                       "--mem_budget_gb", "1")
    assert proc.returncode == 2 and "--max_batch with matrix.ckpt_policy auto:<GiB>" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_an_auto_policy_runs_once_whatever_the_other_checkpointing_dimensions(tmp_path):
    """auto:<GiB> takes no interval, implementation or offload: one run per budget however those
    dimensions are set, nothing said left out for it; two spellings of one budget are one run."""
    spec = load_spec(_spec(tmp_path, matrix={"backend": ["ddp"], "ckpt_interval": [0, 2],
                                             "ckpt_impl": ["torch_reentrant"], "activation_offload": ["none", "torch"],
                                             "ckpt_policy": ["auto:0.2", "auto:0.20"]}))
    runs, skipped = expand(spec)
    assert [r.name for r in runs] == ["ddp-w2-tiny-mb8-fp32-auto0.2"] and skipped == []
    assert "ckpt_impl" not in dict(runs[0].flags) and "ckpt_offload" not in dict(runs[0].flags)


def test_a_budget_no_plan_fits_is_refused_before_the_first_run(tmp_path, capsys):
    """matrix.ckpt_policy auto:<GiB> below what any plan reaches: the sweep is refused whole, in one
    line naming the run and the smallest budget a plan fits, --dry_run included (each such run used to
    be launched and refused when its turn came); a budget a plan fits passes."""
    import sweep

    spec = _spec(tmp_path, matrix={"backend": ["single"], "ckpt_policy": ["auto:0.001", "auto:1"]})
    assert sweep.main([str(spec), "--dry_run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "run " in err and "smallest budget a plan fits is" in err, err
    assert not any((tmp_path / "runs").glob("*/summary.json"))
    fits = _spec(tmp_path, matrix={"backend": ["single"], "ckpt_policy": ["auto:1"]})
    assert sweep.main([str(fits), "--dry_run"]) == 0


@pytest.mark.launch
def test_a_stopped_run_is_ended_by_its_sigterm_not_left_for_the_kill():
    """Stopping a run whose process is stopped (Ctrl-Z, a debugger; SIGSTOP) ends it with SIGTERM at
    once: SIGCONT follows, as Slurm sends them, instead of SIGKILL after the grace period."""
    import signal

    from orchestration.runner import _kill_group

    # A process that handles SIGTERM (as train.py does); one that does not dies of it even stopped.
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                             "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))\nprint('ready', flush=True)\n"
                             "time.sleep(600)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGSTOP)
    _kill_group(proc)
    assert proc.returncode == 3  # its handler ran: not SIGKILL's -9 after the grace period


def test_the_local_and_slurm_executors_share_one_interface(tmp_path):
    """orchestration/executors.py: sweep.py and the planner's verification call either alike."""
    import inspect

    from gptlite.errors import ConfigError
    from orchestration.executors import executor_for
    from orchestration.runner import LocalSweep
    from orchestration.slurm import SlurmSweep
    from orchestration.sweep import SlurmSettings

    run = _planned(tmp_path)
    local = executor_for("t", tmp_path / "runs", 60, [run])
    slurm = executor_for("t", tmp_path / "runs", 60, [run], SlurmSettings())
    assert type(local) is LocalSweep and type(slurm) is SlurmSweep
    for method in ("hold_directory", "check", "run_all"):
        assert (list(inspect.signature(getattr(LocalSweep, method)).parameters)
                == list(inspect.signature(getattr(SlurmSweep, method)).parameters)), method
    # a record made with other settings is refused by either before anything runs or is submitted
    (tmp_path / "runs" / run.name).mkdir(parents=True)
    (tmp_path / "runs" / run.name / "config.json").write_text("{}")
    for executor in (local, slurm):
        with pytest.raises(ConfigError, match="recorded with other settings"):
            executor.check()
