"""Models with conditional computation (tests/support/conditional_model.py: a top-1 mixture of experts whose experts
may get no sample, a classifier with an unused bias): every backend trains them with one process's
semantics, a parameter no sample used gets no update, or refuses them in one line before training
(training/run.py check_unused); none ends in a dead rank (issue 39, case 7)."""

import json

import pytest

from conftest import REPO, in_process, train
from core.config import RunConfig
from gptlite.errors import ConfigError

MODEL = str(REPO / "tests" / "support" / "conditional_model.py")
STEPS = 12
ARGS = ("--model", MODEL, "--precision", "fp32", "--lr_warmup_steps", "0", "--mem_profile_steps", "0",
        "--warmup_steps", "0", "--eval_batches", "1", "--steps", str(STEPS))
BACKENDS = {  # name -> RunConfig fields
    "ddp": {"backend": "ddp"},
    "fsdp": {"backend": "fsdp"},
    "fsdp2": {"backend": "fsdp2"},
    "z2": {"deepspeed_config": "ds_configs/z2.json"},
    "z3": {"deepspeed_config": "ds_configs/z3.json"},
    "accelerate": {"backend": "accelerate"},
}


def _resolve(tmp_path, kind, **fields):
    from training.run import prepare_run

    name = f"r{len(list(tmp_path.glob('resolved-*')))}"  # prepare_run holds its record's name until the process ends
    (tmp_path / f"resolved-{name}").touch()
    return prepare_run(RunConfig(model=MODEL, model_args=f"kind={kind}", steps=2, runs_dir=str(tmp_path / "runs"),
                             run_name=name, **fields))


@pytest.mark.parametrize("kind", ["moe", "unused_bias"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_leaving_parameters_without_gradients_is_refused_before_training(tmp_path, kind, backend):
    """FSDP trained the mixture 3e-4 off one process by step 10 (a missing gradient made a zero one that AdamW
    moved), FSDP2 and ZeRO aborted in gloo, DDP died at step 2 with torch's traceback: refused now, naming
    the flag that trains it (DDP's), before anything is recorded."""
    with pytest.raises(ConfigError) as refused:
        _resolve(tmp_path, kind, **BACKENDS[backend])
    message = str(refused.value)
    assert "\n" not in message and "without a gradient" in message and "--find_unused_parameters" in message, message
    assert ("unused" if kind == "unused_bias" else "moe.0.experts.") in message
    assert not (tmp_path / "runs").exists()


def test_ddp_takes_it_with_find_unused_parameters_and_only_ddp_has_the_flag(tmp_path):
    setup = _resolve(tmp_path, "moe", backend="ddp", find_unused_parameters=True)
    assert setup.cfg.find_unused_parameters
    with pytest.raises(ConfigError, match="find_unused_parameters applies to backend ddp"):
        _resolve(tmp_path, "moe", backend="fsdp", find_unused_parameters=True)
    # One process trains it as it is: a parameter without a gradient gets no update.
    assert _resolve(tmp_path, "moe", backend="single").workload.unused_parameters


def _single(tmp_path, kind) -> list[float]:
    """The one-process run of global batch 8, in this process."""
    import train as script
    from training.cli import build_parser, parse_args
    from training.run import main

    parser = build_parser(description=script.DESCRIPTION, examples=script.EXAMPLES)
    proc = in_process(lambda a: main(parse_args(a, parser=parser)),
                      [*ARGS, "--model_args", f"kind={kind}", "--micro_batch", "8", "--runs_dir", tmp_path / "runs",
                       "--run_name", f"single-{kind}", "--quiet"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (tmp_path / "runs" / f"single-{kind}" / "metrics.jsonl").open()
            if "loss" in json.loads(line)]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["moe", "unused_bias"])
def test_ddp_with_find_unused_parameters_trains_as_one_process(tmp_path, kind):
    """2 ranks of micro-batch 4 against one process of 8, 12 steps: an expert no rank used keeps no gradient
    and AdamW leaves it alone, as in one process (FSDP's zero gradients moved it: 1.8e-5 at step 3)."""
    run = train(tmp_path / "runs", f"ddp-{kind}", *ARGS, "--model_args", f"kind={kind}", "--backend", "ddp",
                "--find_unused_parameters", "--micro_batch", "4", launcher="torchrun").check_ok()
    assert run.config["run"]["find_unused_parameters"] is True
    single = _single(tmp_path, kind)
    losses = [m["loss"] for m in run.metrics]
    assert len(losses) == len(single) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, single)) <= 1e-5, (losses, single)


@pytest.mark.distributed
def test_unused_parameters_the_check_did_not_see_fail_the_run_in_one_line_per_rank(tmp_path):
    """The `late` model uses a branch on the check's 2 samples and never at micro-batch 4: DDP without the
    flag stops at step 2; each rank says why in one line and records its own error; the record is failed
    with it (torch's paragraph and traceback before)."""
    run = train(tmp_path / "runs", "late", *ARGS, "--model_args", "kind=late", "--backend", "ddp", "--micro_batch",
                "4", launcher="torchrun")
    assert run.proc.returncode != 0 and run.summary["status"] == "failed"
    said = "ddp: the last step left parameters without a gradient"
    assert said in run.summary["error"] and "--find_unused_parameters" in run.summary["error"]
    for rank in (0, 1):
        error = json.loads((run.dir / "errors" / f"rank{rank}.json").read_text())
        assert said in error["error"], error
        assert f"rank {rank}: ConfigError: {said}" in run.proc.stderr
    assert "Expected to have finished reduction" not in run.proc.stderr
