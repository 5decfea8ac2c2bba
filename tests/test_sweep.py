"""sweep.py: specs, the runner (real launches), failures, timeouts, reruns."""

import json
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, base_env
from models.spec import parse_model_args
from training.sweep import expand, load_spec

SWEEP = REPO / "sweep.py"


def _spec(tmp_path, **spec) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "runs_dir": str(tmp_path / "runs"), **spec}))
    return str(path)


def _sweep(*args, timeout=900):
    return subprocess.run([sys.executable, str(SWEEP), *args], cwd=REPO, env=base_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_expansion_rules(tmp_path):
    spec = load_spec(_spec(tmp_path, matrix={
        "backend": ["single", "ddp", "fsdp_configs/full_shard.yaml", "ds_configs/z3.json"],
        "ckpt_interval": [0, 2], "ckpt_impl": ["torch_reentrant", "deepspeed"], "world_size": [2]}))
    runs, skipped = expand(spec)
    names = {r.name for r in runs}
    # single runs in one process; ckpt_impl only matters with checkpointing; deepspeed's impls
    # only under DeepSpeed.
    assert "single-w1-tiny-mb8-fp32-ckpt0" in names and not any(n.startswith("single-w2") for n in names)
    assert sum(n.endswith("ckpt0") for n in names) == 4
    assert "deepspeed.z3-w2-tiny-mb8-fp32-ckpt2-deepspeed" in names
    assert not any(n.startswith("ddp") and n.endswith("-deepspeed") for n in names)
    assert len(runs) == 4 + 4 + 1 and len(skipped) == 3
    command = next(r for r in runs if r.backend == "deepspeed").command(spec.directory)
    assert command[0].endswith("deepspeed") and "--num_gpus" in command and "--master_port" in command


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


@pytest.mark.distributed
def test_a_sweep_compares_models_and_the_report_says_which(tmp_path):
    path = _spec(tmp_path, steps=3, matrix={
        "backend": ["single"], "model": ["gptlite", {"model": "examples/my_model.py", "args": {"width": 32},
                                                     "label": "mlp"}]},
        train_args={"warmup_steps": 1, "mem_profile_steps": 1, "eval_batches": 1})
    proc = _sweep(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "report"
    report = subprocess.run([sys.executable, "-m", "analysis.report", str(tmp_path / "runs"), "--out", str(out)],
                            cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    runs_table = (out / "report.md").read_text().split("## Runs", 1)[1].split("##", 1)[0]
    assert "| model " in runs_table and "my_model width=32" in runs_table and "gptlite" in runs_table


@pytest.mark.distributed
def test_a_sweep_records_a_failure_goes_on_and_a_rerun_skips_what_is_done(tmp_path):
    spec = _spec(tmp_path, steps=3, matrix={"backend": ["single", "ddp", "fsdp_configs/full_shard.yaml"],
                                            "micro_batch": [2], "world_size": [2]},
                 train_args={"warmup_steps": 1, "mem_profile_steps": 0, "eval_batches": 1},
                 env={"GPTLITE_FAULT": "kind=error,step=1,rank=1,backend=ddp"})
    first = _sweep(spec)
    assert first.returncode == 1, first.stderr  # the sweep went on, and says that a run failed
    runs = tmp_path / "runs"
    summaries = {p.parent.name: json.loads(p.read_text()) for p in runs.glob("*/summary.json")}
    assert {name: s["status"] for name, s in summaries.items()} == {
        "single-w1-tiny-mb2-fp32-ckpt0": "ok", "ddp-w2-tiny-mb2-fp32-ckpt0": "failed",
        "fsdp.full_shard-w2-tiny-mb2-fp32-ckpt0": "ok"}
    assert "injected fault" in summaries["ddp-w2-tiny-mb2-fp32-ckpt0"]["error"]
    assert "1 failed, 2 ok" in first.stdout
    assert (runs / ".logs" / "ddp-w2-tiny-mb2-fp32-ckpt0.log").stat().st_size > 0

    before = {p: p.stat().st_mtime_ns for p in runs.glob("*/summary.json")}
    again = _sweep(spec)
    assert again.stdout.count("(already done)") == 3
    assert before == {p: p.stat().st_mtime_ns for p in runs.glob("*/summary.json")}

    retried = _sweep(spec, "--retry_failed")
    assert retried.stdout.count("(already done)") == 2 and "ddp-w2-tiny-mb2-fp32-ckpt0: failed" in retried.stdout


@pytest.mark.distributed
def test_a_run_past_its_timeout_is_killed_and_recorded(tmp_path):
    spec = _spec(tmp_path, steps=3, timeout_s=30, matrix={"backend": ["ddp"], "micro_batch": [2], "world_size": [2]},
                 train_args={"mem_profile_steps": 0}, env={"GPTLITE_FAULT": "kind=hang,step=1"})
    proc = _sweep(spec, timeout=300)
    assert proc.returncode == 1, proc.stderr
    summary = json.loads((tmp_path / "runs" / "ddp-w2-tiny-mb2-fp32-ckpt0" / "summary.json").read_text())
    assert summary["status"] == "timeout" and "timed out after 30 s" in summary["error"]
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "runs")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""  # the launcher and both ranks are gone


@pytest.mark.distributed
def test_a_changed_spec_never_reuses_or_overwrites_a_record(tmp_path):
    """The key of a record includes every setting: after `steps` changes, the old record is
    neither taken as done nor overwritten; the sweep refuses before running anything."""
    args = dict(matrix={"backend": ["single"], "micro_batch": [2]},
                train_args={"warmup_steps": 0, "mem_profile_steps": 0, "eval_batches": 1})
    first = _sweep(_spec(tmp_path, steps=2, **args))
    assert first.returncode == 0, first.stderr
    summary = tmp_path / "runs" / "single-w1-tiny-mb2-fp32-ckpt0" / "summary.json"
    before = summary.read_bytes()
    changed = _sweep(_spec(tmp_path, steps=3, **args))
    assert changed.returncode == 2 and "recorded with other settings" in changed.stderr
    assert "--steps '2' then, '3' now" in changed.stderr and len(changed.stderr.strip().splitlines()) == 1
    assert summary.read_bytes() == before


@pytest.mark.distributed
def test_stopping_the_sweep_stops_its_run_and_records_it(tmp_path):
    import signal
    import time

    spec = _spec(tmp_path, steps=200, matrix={"backend": ["ddp"], "micro_batch": [2], "world_size": [2]},
                 train_args={"mem_profile_steps": 0})
    sweep = subprocess.Popen([sys.executable, str(SWEEP), spec], cwd=REPO, env=base_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
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
    ({"matrix": {"backend": ["ddp"]}}, "missing key 'name'"),
    ({"name": "t"}, "missing key 'matrix'"),
    ({"name": "t", "matrix": {"preset": ["tiny"]}}, "missing key 'matrix.backend'"),
    ({"name": "t", "matrix": {"backend": ["ddp"]}, "train_args": {"lr": -1}}, "lr must be > 0"),
    ({"name": "t", "matrix": {"backend": ["ddp"]}, "train_args": {"dropout": "lots"}}, "dropout"),
    ({"name": "t", "matrix": {"backend": ["single"], "world_size": [2], "micro_batch": [0]}}, "micro_batch"),
    ({"name": "t", "matrix": {"backend": ["{bad}"]}}, "hybrid_shard_size"),
])
def test_a_bad_spec_is_refused_before_any_run(tmp_path, spec, message):
    if spec.get("matrix", {}).get("backend") == ["{bad}"]:
        bad = tmp_path / "hybrid.yaml"
        bad.write_text("backend: fsdp\nsharding_strategy: HYBRID_SHARD\nhybrid_shard_size: 3\n")
        spec["matrix"]["backend"] = [str(bad)]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"runs_dir": str(tmp_path / "runs"), **spec}))
    proc = _sweep(str(path), timeout=300)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*/summary.json"))


@pytest.mark.parametrize("flags, message", [
    (("--max_batch", "--mem_budget_gb", "0"), "--mem_budget_gb must be a finite number > 0"),
    (("--max_batch", "--mem_budget_gb", "1", "--probe_steps", "0"), "--probe_steps must be >= 1"),
    (("--max_batch", "--mem_budget_gb", "1", "--max_micro_batch", "0"), "--max_micro_batch must be >= 1"),
])
def test_bad_max_batch_flags_are_refused(tmp_path, flags, message):
    proc = _sweep(_spec(tmp_path, matrix={"backend": ["single"]}), *flags, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
