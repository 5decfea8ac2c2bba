"""Malformed input of every kind: one line naming the field and what is allowed, exit code 2,
no traceback, no run recorded as ok."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, TRAIN, base_env

Z2 = json.loads((REPO / "ds_configs" / "z2.json").read_text())


def ds(**changes) -> dict:
    config = json.loads(json.dumps(Z2))
    for key, value in changes.items():
        if "__" in key:
            section, sub = key.split("__")
            config[section][sub] = value
        else:
            config[key] = value
    return config


# (name, tool, args, file to write as {FILE} (name, content), text the one line must contain)
CASES = [
    # train.py values
    ("unknown backend", "train", ["--backend", "horovod"], None, "argument --backend: invalid choice: 'horovod'"),
    ("negative steps", "train", ["--steps", "-3"], None, "steps must be >= 1"),
    ("micro batch 0", "train", ["--micro_batch", "0"], None, "micro_batch must be >= 1"),
    ("heads do not divide width", "train", ["--n_embd", "100", "--n_head", "3"], None,
     "n_embd must be divisible by n_head"),
    ("unknown precision", "train", ["--precision", "fp8"], None, "argument --precision: invalid choice"),
    ("steps not a number", "train", ["--steps", "ten"], None, "argument --steps: invalid int value"),
    ("dropout out of range", "train", ["--dropout", "1.5"], None, "dropout must be in [0, 1)"),
    ("unknown attention", "train", ["--attention", "flash"], None, "argument --attention: invalid choice"),
    ("offload without checkpointing", "train", ["--ckpt_offload"], None, "ckpt_offload requires ckpt_interval > 0"),
    ("unknown sweep offload", "sweep", ["{FILE}", "--dry_run"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\n  activation_offload: [gpu]\n"),
     "matrix.activation_offload values must be none, torch or prefetch<H>"),
    ("prefetch offload without checkpointing", "train", ["--offload_activations"], None,
     "offload_activations requires ckpt_interval > 0"),
    ("negative loading horizon", "train", ["--ckpt_interval", "1", "--offload_activations",
                                           "--activation_loading_horizon", "-1"], None,
     "activation_loading_horizon must be >= 0"),
    ("prefetch offload of deepspeed checkpoint", "train", ["--deepspeed_config", "ds_configs/z1.json",
                                                          "--ckpt_interval", "1", "--ckpt_impl", "deepspeed",
                                                          "--offload_activations"], None,
     "offload_activations with ckpt_impl deepspeed"),
    ("accelerate fsdp plugin on CPU", "train", ["--backend", "accelerate", "--accelerate_plugin", "fsdp"], None,
     "accelerate_plugin fsdp"),
    ("unknown accelerate plugin", "train", ["--backend", "accelerate", "--accelerate_plugin", "megatron"], None,
     "argument --accelerate_plugin: invalid choice"),
    ("deepspeed checkpointing on ddp", "train", ["--backend", "ddp", "--ckpt_interval", "1", "--ckpt_impl",
                                                   "deepspeed"], None, "ckpt_impl deepspeed needs the deepspeed backend"),
    ("save_every without save_dir", "train", ["--save_every", "5"], None, "save_every and resume need --save_dir"),
    ("zero memory budget", "train", ["--mem_budget_gb", "0"], None, "mem_budget_gb must be > 0"),
    ("negative learning rate", "train", ["--lr", "-1"], None, "lr must be > 0"),
    ("resume and init_from", "train", ["--resume", "--save_dir", "x", "--init_from", "y"], None,
     "resume and init_from exclude each other"),
    ("missing init_from file", "train", ["--init_from", "/nonexistent/model.pt"], None, "init_from: file not found"),
    ("fsdp config on ddp", "train", ["--backend", "ddp", "--fsdp_config", "fsdp_configs/full_shard.yaml"], None,
     "fsdp_config applies to backends fsdp and fsdp2"),
    # FSDP YAML
    ("fsdp unknown key", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "shardng_strategy: FULL_SHARD\n"),
     "unknown key 'shardng_strategy' (allowed: backend, sharding_strategy"),
    ("fsdp bad strategy", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "sharding_strategy: FULL\n"),
     "sharding_strategy must be one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD"),
    ("fsdp wrong type", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "cpu_offload: 'yes'\n"),
     "cpu_offload must be true or false"),
    ("fsdp invalid YAML", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "a: b\n  c: d\n"), "not valid YAML (line 2"),
    ("fsdp bad dtype", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "mixed_precision:\n  param_dtype: fp8\n"),
     "mixed_precision.param_dtype must be one of fp32, bf16, fp16"),
    ("fsdp hybrid shard of one", "train", ["--fsdp_config", "{FILE}"],
     ("c.yaml", "sharding_strategy: HYBRID_SHARD\nhybrid_shard_size: 1\n"), "hybrid_shard_size must be >= 2"),
    # DeepSpeed JSON
    ("ds top-level typo", "train", ["--deepspeed_config", "{FILE}"], ("c.json", json.dumps(ds(zero_optimisation={}))),
     "unknown key 'zero_optimisation', which DeepSpeed would silently ignore (did you mean 'zero_optimization'?)"),
    ("ds batch mismatch", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(train_batch_size=64))), "train_batch_size 64 != train_micro_batch_size_per_gpu 8"),
    ("ds invalid JSON", "train", ["--deepspeed_config", "{FILE}"], ("c.json", '{"stage": 1,}'), "not valid JSON (line 1"),
    ("ds zero key typo", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(zero_optimization__overlap_com=True))), "zero_optimization.overlap_com' (did you mean 'overlap_comm'?)"),
    ("ds other betas", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(optimizer={"type": "AdamW", "params": {"betas": [0.9, 0.95]}}))),
     "optimizer.params.betas is [0.9, 0.95]; every backend uses [0.8, 0.999]"),
    ("ds nvme without a path", "train", ["--deepspeed_config", "ds_configs/z3_infinity_nvme.json"], None,
     "offloads to NVMe; pass --nvme_path DIR"),
    ("ds config missing", "train", ["--deepspeed_config", "ds_configs/z9.json"], None, "--deepspeed_config: file not found"),
    # sweep specs
    ("sweep unknown matrix key", "sweep", ["{FILE}"], ("s.yaml", "name: s\nmatrix:\n  backend: [ddp]\n  micro_btch: [2]\n"),
     "unknown key 'matrix.micro_btch'"),
    ("sweep bad backend", "sweep", ["{FILE}"], ("s.yaml", "name: s\nmatrix:\n  backend: [horovod]\n"),
     "matrix.backend: 'horovod' is neither a backend"),
    ("sweep unknown train flag", "sweep", ["{FILE}"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [ddp]\ntrain_args:\n  learning_rate: 3\n"),
     "train_args: unknown train.py flag 'learning_rate'"),
    ("sweep invalid YAML", "sweep", ["{FILE}"], ("s.yaml", "name: s\nmatrix: [\n"), "not valid YAML"),
    # data files
    ("data missing", "train", ["--data", "/nonexistent/input.txt"], None, "--data: file not found"),
    ("data empty", "train", ["--data", "{FILE}"], ("d.txt", ""), "--data: file is empty"),
    ("data not UTF-8", "train", ["--data", "{FILE}"], ("d.txt", b"\xff\xfe\xfa text"), "--data: not UTF-8 text"),
    ("data too short", "train", ["--data", "{FILE}", "--preset", "tiny"], ("d.txt", "short text"),
     "--data: too short for block_size 64"),
]


@pytest.mark.parametrize("name, tool, args, file, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, name, tool, args, file, message):
    if file:
        path = tmp_path / file[0]
        path.write_bytes(file[1] if isinstance(file[1], bytes) else file[1].encode())
        args = [a.replace("{FILE}", str(path)) for a in args]
    runs = tmp_path / "runs"
    script = TRAIN if tool == "train" else REPO / "sweep.py"
    extra = ["--runs_dir", str(runs)] if tool == "train" else []
    proc = subprocess.run([sys.executable, str(script), *args, *extra], cwd=REPO, env=base_env(), capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{script.name}: error:") and message in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not any(json.loads(p.read_text()).get("status") == "ok" for p in runs.rglob("summary.json"))
