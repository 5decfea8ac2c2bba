"""Malformed input of every kind: one line naming the field and what is allowed, exit code 2,
no traceback, no run recorded as ok."""

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TRAIN, base_env, check_refused, launch_command, tool_in_process

Z2 = json.loads((REPO / "ds_configs" / "z2.json").read_text())
DEEP = 100_000  # levels of nesting: every parser here recursed once per level (a RecursionError traceback)


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
    ("unknown sdpa kernel", "train", ["--attention", "sdpa", "--sdpa_kernel", "fa3"], None,
     "argument --sdpa_kernel: invalid choice: 'fa3'"),
    ("sdpa kernel with naive attention", "train", ["--sdpa_kernel", "math"], None,
     "sdpa_kernel math needs --attention sdpa"),
    ("CUDA sdpa kernel on a CPU", "train", ["--attention", "sdpa", "--sdpa_kernel", "cudnn"], None,
     "sdpa_kernel cudnn is a CUDA kernel; on cpu use auto, flash or math"),
    ("CPU flash attention with dropout", "train", ["--attention", "sdpa", "--sdpa_kernel", "flash"], None,
     "sdpa_kernel flash on a CPU has no dropout"),
    ("unknown block class", "train", ["--block_class", "Layer"], None,
     "block_class Layer: no such module class holding parameters in the model (found: Block"),
    ("compile with no warm-up step", "train", ["--compile", "--warmup_steps", "0"], None,
     "warmup_steps must be >= 1 with --compile"),
    ("compile backend without compile", "train", ["--compile_backend", "aot_eager"], None,
     "compile_backend and compile_mode need --compile"),
    ("unknown compile backend", "train", ["--compile", "--compile_backend", "tvm"], None,
     "argument --compile_backend: invalid choice"),
    ("inductor mode on aot_eager", "train", ["--compile", "--compile_backend", "aot_eager", "--compile_mode",
                                             "max-autotune"], None, "compile_mode max-autotune is inductor's"),
    ("unknown tracker", "train", ["--tracker", "tensorboard", "--tracker", "mlflow"], None,
     "tracker must be one of tensorboard, wandb, csv (got 'mlflow')"),
    ("sweep unknown tracker", "sweep", ["{FILE}", "--dry_run", "--tracker", "comet"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\n"), "tracker must be one of tensorboard, wandb, csv"),
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
    ("selective checkpointing without blocks", "train", ["--ckpt_policy", "selective"], None,
     "ckpt_policy selective requires ckpt_interval > 0"),
    ("selective checkpointing, reentrant", "train", ["--ckpt_interval", "1", "--ckpt_policy", "selective",
                                                     "--ckpt_impl", "torch_reentrant"], None,
     "ckpt_policy selective needs ckpt_impl torch_nonreentrant (got torch_reentrant)"),
    ("selective checkpointing, DeepSpeed's", "train", ["--deepspeed_config", "ds_configs/z1.json", "--ckpt_interval",
                                                       "1", "--ckpt_policy", "selective", "--ckpt_impl", "deepspeed"],
     None, "ckpt_policy selective needs ckpt_impl torch_nonreentrant (got deepspeed)"),
    ("selective checkpointing under ZeRO-3", "train", ["--deepspeed_config", "ds_configs/z3.json", "--ckpt_interval",
                                                       "1", "--ckpt_policy", "selective"], None,
     "ckpt_policy selective under ZeRO stage 3 gives wrong gradients"),
    ("selective checkpointing offloaded", "train", ["--ckpt_interval", "1", "--ckpt_policy", "selective",
                                                    "--ckpt_offload"], None,
     "ckpt_policy selective with --ckpt_offload: not supported yet"),
    ("unknown op to keep", "train", ["--ckpt_interval", "1", "--ckpt_policy", "selective", "--ckpt_save_ops",
                                     "mm,matmull"], None, "ckpt_save_ops: 'matmull' is not an aten operator"),
    ("ops to keep under full checkpointing", "train", ["--ckpt_interval", "1", "--ckpt_save_ops", "mm"], None,
     "ckpt_save_ops needs --ckpt_policy selective"),
    ("a plan for another model", "train", ["--ckpt_plan", "full,none"], None,
     "ckpt_plan has 2 entries; the model has 6 blocks"),
    ("a plan with an unknown choice", "train", ["--ckpt_plan", "full,none,full,none,full,partial"], None,
     "ckpt_plan: 'partial' is not a choice (one of none, selective, full"),
    ("a plan and an interval", "train", ["--ckpt_plan", "full,none,full,none,full,none", "--ckpt_interval", "2"],
     None, "ckpt_plan names every block's checkpointing: drop --ckpt_interval"),
    ("a selective plan under ZeRO-3", "train", ["--deepspeed_config", "ds_configs/z3.json", "--ckpt_plan",
                                                "selective,none,none,none,none,none"], None,
     "ckpt_policy selective under ZeRO stage 3 gives wrong gradients"),
    ("auto without a budget", "train", ["--ckpt_policy", "auto"], None,
     "ckpt_policy auto needs --mem_budget_gb"),
    ("auto with an interval", "train", ["--ckpt_policy", "auto", "--mem_budget_gb", "1", "--ckpt_interval", "1"], None,
     "ckpt_policy auto chooses every block's checkpointing itself: drop --ckpt_interval"),
    ("auto and a plan", "train", ["--ckpt_policy", "auto", "--mem_budget_gb", "1", "--ckpt_plan",
                                  "full,none,full,none,full,none"], None, "ckpt_plan is what --ckpt_policy auto decides"),
    ("auto under a budget no plan fits", "train", ["--ckpt_policy", "auto", "--mem_budget_gb", "0.01"], None,
     "no checkpointing plan fits mem_budget_gb 0.01: the smallest budget a plan fits is"),
    ("a compile memory budget without compiling", "train", ["--compile_memory_budget", "0.5"], None,
     "compile_memory_budget needs --compile with compile_backend inductor"),
    ("a compile memory budget for aot_eager", "train", ["--compile", "--compile_backend", "aot_eager",
                                                        "--compile_memory_budget", "0.5"], None,
     "compile_memory_budget needs --compile with compile_backend inductor"),
    ("a compile memory budget above 1", "train", ["--compile", "--compile_memory_budget", "1.5", "--dropout", "0"],
     None, "compile_memory_budget must be between 0 and 1 (got 1.5)"),
    ("a compile memory budget with dropout", "train", ["--compile", "--compile_memory_budget", "0.5"], None,
     "compile_memory_budget below 1 with dropout 0.1"),
    ("a compile memory budget with an HF model's own dropout", "train",
     ["--model", "hf:gpt2", "--model_args", "n_layer=2,n_embd=64,n_head=4", "--compile", "--compile_memory_budget",
      "0.5"], None, "compile_memory_budget below 1 with dropout (the model default)"),
    ("a compile memory budget with a model file", "train",
     ["--model", "examples/my_model.py", "--compile", "--compile_memory_budget", "0.5"], None,
     "compile_memory_budget below 1 needs a model without dropout"),
    ("auto keeping ops under ZeRO-3", "train", ["--ckpt_policy", "auto", "--mem_budget_gb", "1", "--ckpt_save_ops", "mm",
                                                 "--deepspeed_config", "ds_configs/z3.json"], None,
     "under ZeRO stage 3 --ckpt_policy auto plans with none and full only: drop --ckpt_save_ops"),
    ("auto compiled", "train", ["--ckpt_policy", "auto", "--mem_budget_gb", "1", "--compile"], None,
     "ckpt_policy auto with --compile: not supported yet"),
    ("save_every without save_dir", "train", ["--save_every", "5"], None, "save_every and resume need --save_dir"),
    ("zero memory budget", "train", ["--mem_budget_gb", "0"], None, "mem_budget_gb must be > 0"),
    ("zero DDP bucket", "train", ["--backend", "ddp", "--ddp_bucket_cap_mb", "0"], None, "ddp_bucket_cap_mb must be > 0"),
    ("DDP bucket under FSDP", "train", ["--backend", "fsdp", "--ddp_bucket_cap_mb", "5"], None,
     "ddp_bucket_cap_mb applies to backend ddp (got backend 'fsdp')"),
    ("negative learning rate", "train", ["--lr", "-1"], None, "lr must be > 0"),
    ("resume and init_from", "train", ["--resume", "--save_dir", "x", "--init_from", "y"], None,
     "resume and init_from exclude each other"),
    ("missing init_from file", "train", ["--init_from", "/nonexistent/model.pt"], None, "init_from: file not found"),
    ("fsdp config on ddp", "train", ["--backend", "ddp", "--fsdp_config", "fsdp_configs/full_shard.yaml"], None,
     "fsdp_config applies to backends fsdp and fsdp2"),
    # the model (--model, --model_args)
    ("unknown transformers model type", "train", ["--model", "hf:nosuchmodel"], None,
     "model hf:nosuchmodel: not a transformers model type"),
    ("GPT-lite size flag on another model", "train", ["--model", "hf:llama", "--n_layer", "2"], None,
     "n_layer applies to --model gptlite"),
    ("missing model file", "train", ["--model", "nowhere/my_model.py"], None, "model: file not found"),
    ("model file whose get_model raises", "train", ["--model", "{FILE}"],
     ("m.py", "import torch\ndef get_model():\n    raise RuntimeError('no such layer')\n"
              "def get_dataset():\n    return [(torch.ones(4), 1)] * 20\n"),
     "get_model() failed: RuntimeError: no such layer"),
    ("model file whose items are not pairs", "train", ["--model", "{FILE}"],
     ("m.py", "import torch\ndef get_model():\n    return torch.nn.Linear(4, 2)\n"
              "def get_dataset():\n    return [torch.ones(4)] * 20\n"),
     "sample 0 of the train split is Tensor; a sample must be an (input, target) pair"),
    ("model_args without values", "train", ["--model", "hf:gpt2", "--model_args", "n_layer"], None,
     "model_args: expected key=value pairs"),
    ("model_args nested 100,000 deep", "train", ["--model", "hf:gpt2", "--model_args",
                                                 "n_layer=" + "[" * DEEP + "]" * DEEP], None,
     "model_args: n_layer: the value is nested too deeply to read (200000 characters)"),
    # values checked before anything starts (the trust issue)
    ("infinite learning rate", "train", ["--lr", "inf"], None, "lr must be a finite number"),
    ("NaN gradient clipping", "train", ["--grad_clip", "nan"], None, "grad_clip must be a finite number"),
    ("seed beyond 32 bits", "train", ["--seed", str(2**64)], None, "seed must be in [0, 4294967295]"),
    ("infinite timeout", "train", ["--dist_timeout_s", "inf"], None, "dist_timeout_s must be a finite number"),
    ("cuda without CUDA", "train", ["--device", "cuda"], None, "device cuda: CUDA is not available"),
    ("runs_dir is a file", "train", ["--runs_dir", "{FILE}"], ("f.txt", "x"), "runs_dir: {FILE} exists and is not a"),
    ("runs_dir not writable", "train", ["--runs_dir", "/proc/gptlite-runs"], None, "runs_dir: /proc/gptlite-runs is not"
                                                                                 " writable"),
    ("run_name too long", "train", ["--run_name", "r" * 300], None, "run_name must be a plain directory name of at most"),
    ("save_dir is a file", "train", ["--save_dir", "{FILE}", "--save_every", "1"], ("f.txt", "x"),
     "save_dir: {FILE} exists and is not a directory"),
    ("save_dir not writable", "train", ["--save_dir", "/proc/gptlite-ckpt", "--save_every", "1"], None,
     "save_dir: /proc/gptlite-ckpt is not writable"),
    # Files nobody signed (tests/unit/test_checkpoint_trust.py: refused without --trust_checkpoint), trusted:
    ("init_from a text file", "train", ["--init_from", "{FILE}", "--trust_checkpoint"], ("m.pt", "not a checkpoint"),
     "is not a file written by python -m training.export"),
    ("init_from a raw state dict", "train", ["--init_from", "{FILE}", "--trust_checkpoint"], ("m.pt", "{STATE_DICT}"),
     "needs 'model' and 'step'; a plain state dict has neither"),
    ("init_from another preset", "train", ["--init_from", "{FILE}", "--preset", "tiny", "--trust_checkpoint"],
     ("m.pt", "{SMALL_EXPORT}"),
     "holds another model than this run's"),
    ("ds string value", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(optimizer={"type": "AdamW", "params": {"lr": "0.001"}}))),
     "optimizer.params.lr must be a number (got '0.001')"),
    ("ds duplicate key", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds())[:-1] + ', "gradient_clipping": 2.0}'), "duplicate key 'gradient_clipping'"),
    ("ds NaN", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(gradient_clipping=float("nan")), indent=1)), "gradient_clipping must be a number"),
    ("ds file value named by file and key", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(optimizer={"type": "AdamW", "params": {"lr": -1}}))),
     "c.json: optimizer.params.lr must be > 0 (got -1)"),
    ("ds stage listed once", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(zero_optimization={"stage": 7}))), "Input should be 0, 1, 2 or 3"),
    ("fsdp section not a mapping", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "mixed_precision: 3\n"),
     "mixed_precision must be a mapping"),
    ("fsdp null spelled as YAML does", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "backward_prefetch: x\n"),
     "BACKWARD_PRE, BACKWARD_POST, null (got 'x')"),
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
    ("fsdp2 mesh not dividing the world", "train", ["--fsdp_config", "{FILE}"],
     ("c.yaml", "backend: fsdp2\nmesh:\n  shard: 2\n"), "mesh.shard 2 must divide the world size 1"),
    ("fsdp mesh on FSDP1", "train", ["--fsdp_config", "{FILE}"],
     ("c.yaml", "sharding_strategy: HYBRID_SHARD\nmesh:\n  shard: 2\n"), "c.yaml: mesh: backend fsdp (FSDP1) takes no device mesh"),
    ("ds mesh", "train", ["--deepspeed_config", "{FILE}"], ("c.json", json.dumps(ds(mesh={"shard": 2}))),
     "mesh: DeepSpeed takes no device mesh"),
    # DeepSpeed JSON
    ("ds top-level typo", "train", ["--deepspeed_config", "{FILE}"], ("c.json", json.dumps(ds(zero_optimisation={}))),
     "unknown key 'zero_optimisation', which DeepSpeed would silently ignore (did you mean 'zero_optimization'?)"),
    ("ds batch mismatch", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(train_batch_size=64))), "train_batch_size 64 != train_micro_batch_size_per_gpu 8"),
    ("ds invalid JSON", "train", ["--deepspeed_config", "{FILE}"], ("c.json", '{"stage": 1'), "not valid JSON (line 1"),
    ("ds zero key typo", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(zero_optimization__overlap_com=True))), "zero_optimization.overlap_com' (did you mean 'overlap_comm'?)"),
    ("ds other betas", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(optimizer={"type": "AdamW", "params": {"betas": [0.9, 0.95]}}))),
     "optimizer.params.betas is [0.9, 0.95]; every backend uses [0.8, 0.999]"),
    ("ds nvme without a path", "train", ["--deepspeed_config", "ds_configs/z3_infinity_nvme.json"], None,
     "offloads to NVMe; pass --nvme_path DIR"),
    ("ds config missing", "train", ["--deepspeed_config", "ds_configs/z9.json"], None, "--deepspeed_config: file not found"),
    # A name longer than the filesystem allows (DeepSpeed's autotuner passes configs as base64 text).
    ("ds config name too long", "train", ["--deepspeed_config", "x" * 300], None, "--deepspeed_config: file not found"),
    ("ds inline config with an unknown key", "train",
     ["--deepspeed_config", base64.urlsafe_b64encode(json.dumps(ds(bogus=1)).encode()).decode()], None,
     "--deepspeed_config (inline base64 config): unknown key 'bogus'"),
    ("fsdp config name too long", "train", ["--fsdp_config", "y" * 300], None, "--fsdp_config: file not found"),
    # DeepSpeed values its parser takes and a run then fails on (steps_per_print 0 divided by at step 0,
    # deepspeed.initialize's asserts, a monitor's directory made at the first step) or coerces
    ("ds steps_per_print 0", "train", ["--deepspeed_config", "{FILE}"], ("c.json", json.dumps(ds(steps_per_print=0))),
     "steps_per_print must be >= 1 (got 0)"),
    ("ds boolean as a word", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(wall_clock_breakdown="yes"))), "wall_clock_breakdown must be true or false (got 'yes')"),
    ("ds prescale under ZeRO-2", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(prescale_gradients=True))), "prescale_gradients true is not supported by ZeRO-2"),
    ("ds predivide under ZeRO-2", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(gradient_predivide_factor=2.0))), "gradient_predivide_factor must be 1.0 with ZeRO-2"),
    ("ds section null", "train", ["--deepspeed_config", "{FILE}"], ("c.json", json.dumps(ds(optimizer=None))),
     "optimizer must be an object (got None)"),
    ("ds section a list", "train", ["--deepspeed_config", "{FILE}"], ("c.json", json.dumps(ds(zero_optimization=[]))),
     "zero_optimization must be an object (got [])"),
    ("ds precision as a word", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(fp16={"enabled": "yes"}))), "fp16.enabled must be true or false (got 'yes')"),
    ("ds parameter offload under ZeRO-2", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(zero_optimization__offload_param={"device": "cpu"}))),
     "zero_optimization.offload_param is ZeRO-3's (DeepSpeed ignores it at stage 2"),
    ("ds torch_autocast", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(torch_autocast={"enabled": True, "dtype": "bfloat16"}))),
     "torch_autocast.enabled: a run's precision is --precision"),
    ("ds warm-up from another rate", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(scheduler={"type": "WarmupLR", "params": {"warmup_type": "linear",
                                                                          "warmup_min_lr": 0.5}}))),
     "scheduler.params.warmup_min_lr is 0.5; every backend warms up from 0"),
    ("ds checkpointing count a word", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(activation_checkpointing={"number_checkpoints": "x"}))),
     "activation_checkpointing.number_checkpoints must be an integer (got 'x')"),
    ("ds monitor writing nowhere", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", json.dumps(ds(tensorboard={"enabled": True, "output_path": "/proc/gptlite-tb", "job_name": "x"}))),
     "tensorboard.output_path: /proc/gptlite-tb is not writable"),
    ("fsdp backend a list", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "backend: [fsdp]\n"),
     "backend must be one of fsdp, fsdp2 (got ['fsdp'])"),
    ("fsdp key twice", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "backend: fsdp\nbackend: fsdp2\n"),
     "duplicate key 'backend'"),
    # flags that only mean something beside another
    ("keep_checkpoints without save_dir", "train", ["--keep_checkpoints", "5"], None,
     "keep_checkpoints needs --save_dir"),
    ("loading horizon without offload", "train", ["--activation_loading_horizon", "4"], None,
     "activation_loading_horizon needs --offload_activations"),
    ("empty tracker", "train", ["--tracker", ""], None, "tracker must be one of tensorboard, wandb, csv (got an empty"),
    ("tracker with an empty item", "train", ["--tracker", "csv,"], None,
     "tracker must be one of tensorboard, wandb, csv (got an empty name in 'csv,')"),
    ("run_name with a newline", "train", ["--run_name", "a\nb"], None,
     "run_name must be a plain directory name of at most 200 characters, not starting with '.', without '/' or "
     "control characters (got 'a\\nb': U+000A)"),
    ("run_name with a terminal escape", "train", ["--run_name", "\x1b[31mred"], None, "control characters (got "
                                                                                     "'\\x1b[31mred': U+001B)"),
    ("run_name with a right-to-left override", "train", ["--run_name", "run\u202etxt.exe"], None, "U+202E"),
    # configs nested deeper than any parser here recurses (PyYAML's composer, hjson's decoder)
    ("ds config nested 100,000 deep", "train", ["--deepspeed_config", "{FILE}"],
     ("c.json", '{"a": ' * DEEP + "1" + "}" * DEEP),
     "c.json: nested too deeply at line 1, column 193: mappings and lists may nest at most 32 levels deep"),
    ("ds inline config nested 1,000 deep", "train",
     ["--deepspeed_config", base64.urlsafe_b64encode(('{"a": ' * 1000 + "1" + "}" * 1000).encode()).decode()], None,
     "--deepspeed_config (inline base64 config): nested too deeply at line 1, column 193"),
    ("fsdp config nested 100,000 deep", "train", ["--fsdp_config", "{FILE}"],
     ("c.yaml", "a: " + "[" * DEEP + "]" * DEEP),
     "c.yaml: nested too deeply at line 1, column 35: mappings and lists may nest at most 32 levels deep"),
    ("fsdp config nested 40 deep by indentation", "train", ["--fsdp_config", "{FILE}"],
     ("c.yaml", "".join(f"{' ' * i}k{i}:\n" for i in range(40)) + " " * 40 + "1\n"),
     "nested too deeply at line 33, column 33"),
    ("fsdp config nested deep through aliases", "train", ["--fsdp_config", "{FILE}"],
     ("c.yaml", "a0: &a0 [[[[[[[[[[1]]]]]]]]]]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 40))),
     "nested too deeply at line 23, column 12"),
    ("fsdp config holding itself", "train", ["--fsdp_config", "{FILE}"], ("c.yaml", "a: &a [*a]\n"),
     "an alias inside its own anchor, nested endlessly, at line 1, column 8"),
    # sweep specs
    ("sweep unknown matrix key", "sweep", ["{FILE}"], ("s.yaml", "name: s\nmatrix:\n  backend: [ddp]\n  micro_btch: [2]\n"),
     "unknown key 'matrix.micro_btch'"),
    ("sweep bad backend", "sweep", ["{FILE}"], ("s.yaml", "name: s\nmatrix:\n  backend: [horovod]\n"),
     "matrix.backend: 'horovod' is neither a backend"),
    ("sweep unknown train flag", "sweep", ["{FILE}"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [ddp]\ntrain_args:\n  learning_rate: 3\n"),
     "train_args: unknown train.py flag 'learning_rate'"),
    ("sweep invalid YAML", "sweep", ["{FILE}"], ("s.yaml", "name: s\nmatrix: [\n"), "not valid YAML"),
    ("sweep unknown checkpoint implementation", "sweep", ["{FILE}", "--dry_run"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\n  ckpt_impl: [bogus]\n"),
     "matrix.ckpt_impl values must be among torch_nonreentrant, torch_reentrant, deepspeed, deepspeed_nonreentrant "
     "(got 'bogus')"),
    ("sweep key twice", "sweep", ["{FILE}"], ("s.yaml", "name: s\nmatrix:\n  backend: [ddp]\n  backend: [single]\n"),
     "duplicate key 'backend'"),
    ("sweep runs_dir not writable", "sweep", ["{FILE}"],
     ("s.yaml", "name: s\nruns_dir: /proc/gptlite-sweeps\nmatrix:\n  backend: [single]\n"),
     "runs_dir: /proc/gptlite-sweeps is not writable"),
    ("sweep budget without search", "sweep", ["{FILE}", "--mem_budget_gb", "1"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\n"), "--mem_budget_gb is --max_batch's budget"),
    ("sweep Slurm flag run here", "sweep", ["{FILE}", "--time_min", "-3"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\n"), "--time_min is a Slurm setting: it needs --executor slurm"),
    ("sweep spec nested 100,000 deep", "sweep", ["{FILE}", "--dry_run"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\ntrain_args:\n  x: " + "[" * DEEP + "]" * DEEP + "\n"),
     "s.yaml: nested too deeply at line 5, column 36: mappings and lists may nest at most 32 levels deep"),
    ("sweep spec in JSON nested 100,000 deep", "sweep", ["{FILE}", "--dry_run"],
     ("s.json", '{"name": "s", "matrix": {"backend": ["single"]}, "env": ' + "[" * DEEP + "]" * DEEP + "}"),
     "s.json: nested too deeply at line 1, column 88"),
    ("sweep compile listed twice", "sweep", ["{FILE}", "--dry_run"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\n  compile: [eager, none, eager]\n"),
     "matrix.compile: each value at most once ('eager' is listed 2 times)"),
    ("sweep micro-batch listed twice", "sweep", ["{FILE}", "--dry_run"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\n  micro_batch: [4, 4]\n"),
     "matrix.micro_batch: each value at most once (4 is listed 2 times)"),
    ("sweep unknown sbatch option run here", "sweep", ["{FILE}", "--dry_run"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\nexecutor:\n  sbatch: {qos: high, constrant: a100}\n"),
     "executor.sbatch: 'constrant' is not an sbatch option for a job (did you mean 'constraint'?)"),
    ("sweep sbatch option unlike any", "sweep", ["{FILE}", "--dry_run"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\nexecutor:\n  sbatch: {bogus: 1}\n"),
     "executor.sbatch: 'bogus' is not an sbatch option for a job (see man sbatch, e.g. qos, constraint, mem, gres)"),
    ("sweep name with a newline", "sweep", ["{FILE}", "--dry_run"],
     ("s.yaml", 'name: "a\\nb"\nmatrix:\n  backend: [single]\n'),
     "name must be a plain directory name of at most 200 characters, not starting with '.', without '/' or control "
     "characters (got 'a\\nb': U+000A)"),
    ("sweep tracker with an empty item", "sweep", ["{FILE}", "--dry_run", "--tracker", "csv,"],
     ("s.yaml", "name: s\nmatrix:\n  backend: [single]\n"), "(got an empty name in 'csv,')"),
    # data files
    ("data missing", "train", ["--data", "/nonexistent/input.txt"], None, "--data: file not found"),
    ("data name too long", "train", ["--data", "z" * 300], None, "--data: file not found"),
    ("data empty", "train", ["--data", "{FILE}"], ("d.txt", ""), "--data: file is empty"),
    ("data not UTF-8", "train", ["--data", "{FILE}"], ("d.txt", b"\xff\xfe\xfa text"), "--data: not UTF-8 text"),
    ("data too short", "train", ["--data", "{FILE}", "--preset", "tiny"], ("d.txt", "short text"),
     "--data: too short for block_size 64"),
]


def _write(path, content) -> None:
    """A case's file; {STATE_DICT} and {SMALL_EXPORT} are torch files made here."""
    import torch

    from gptlite.model import build_model, preset

    if content == "{STATE_DICT}":
        torch.save(build_model(preset("tiny", vocab_size=65), 0).state_dict(), path)
    elif content == "{SMALL_EXPORT}":
        torch.save({"model": build_model(preset("small", vocab_size=65), 0).state_dict(), "step": 3}, path)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


def _case(tmp_path, args, file, message):
    if file:
        path = tmp_path / file[0]
        _write(path, file[1])
        args = [a.replace("{FILE}", str(path)) for a in args]
        message = message.replace("{FILE}", str(path))
    return args, message


@pytest.mark.parametrize("name, tool, args, file, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, name, tool, args, file, message):
    args, message = _case(tmp_path, args, file, message)
    runs = tmp_path / "runs"
    extra = ["--runs_dir", str(runs)] if tool == "train" and "--runs_dir" not in args else []
    check_refused(tool_in_process(tool, [*args, *extra]), f"{tool}.py", message, runs)


# As processes, where the exit code and the one line are the interpreter's own: one case of each
# kind of exit train.py has for bad input (argparse's, an early ConfigError, a DataError, one raised
# after the model is built; as under torchrun below) and the sweep's. Every case runs in process above.
AS_PROCESS = ("unknown backend", "ds batch mismatch", "data too short", "auto under a budget no plan fits",
              "sweep unknown matrix key")
PROCESS_CASES = [c for c in CASES if c[0] in AS_PROCESS]
assert len(PROCESS_CASES) == len(AS_PROCESS)


@pytest.mark.launch
@pytest.mark.parametrize("name, tool, args, file, message", PROCESS_CASES, ids=[c[0] for c in PROCESS_CASES])
def test_bad_input_as_a_process(tmp_path, name, tool, args, file, message):
    args, message = _case(tmp_path, args, file, message)
    runs = tmp_path / "runs"
    script = TRAIN if tool == "train" else REPO / "sweep.py"
    extra = ["--runs_dir", str(runs)] if tool == "train" and "--runs_dir" not in args else []
    proc = subprocess.run([sys.executable, str(script), *args, *extra], cwd=REPO, env=base_env(), capture_output=True,
                          text=True, timeout=120)
    check_refused(proc, script.name, message, runs)


# Under torchrun, every case goes one way from the moment it is caught (an error raised before any
# process group, written to torch elastic's error file, which torchrun prints once): what is tested
# here is that way, through each kind of exit train.py has for bad input: argparse's (a flag's
# choices), a ConfigError raised early (a backend config file's batch against the flags), a
# DataError (the data), and one raised late, after the model is built (the checkpointing planner).
# Every case above runs under plain python (in this process), and AS_PROCESS's as a process too.
UNDER_TORCHRUN = ("unknown backend", "ds batch mismatch", "data too short", "auto under a budget no plan fits",
                  "ds config nested 100,000 deep")
TRAIN_CASES = [c for c in CASES if c[0] in UNDER_TORCHRUN]
assert len(TRAIN_CASES) == len(UNDER_TORCHRUN)


@pytest.mark.distributed
@pytest.mark.parametrize("name, tool, args, file, message", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_bad_input_under_torchrun(tmp_path, name, tool, args, file, message):
    """Two ranks: the root cause is said once (torch elastic's error file, which torchrun prints),
    no traceback comes from the suite's code, and nothing is recorded."""
    args, message = _case(tmp_path, args, file, message)
    runs = tmp_path / "runs"
    extra = ["--runs_dir", str(runs)] if "--runs_dir" not in args else []
    if not any(a in args for a in ("--backend", "--fsdp_config", "--deepspeed_config")):
        extra += ["--backend", "ddp"]
    proc = subprocess.run([*launch_command("torchrun", 2), *args, *extra], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count(message) == 1, proc.stderr
    ours = [line for line in proc.stderr.splitlines()
            if line.strip().startswith(f'File "{REPO}') and f"{REPO}/.venv" not in line]
    assert not ours, "\n".join(ours)
    assert not list(runs.rglob("summary.json"))


# DeepSpeed's launcher and `accelerate launch` (which runs torchrun's agent, as above): a config no
# parser here could read, refused where every rank reads it; rank 0 says it once (training/cli.py
# report_bad_input).
DEEP_CONFIG = next(c for c in CASES if c[0] == "ds config nested 100,000 deep")


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["deepspeed", "accelerate"])
def test_a_config_nested_too_deeply_is_said_once_under_deepspeed_and_accelerate_launch(tmp_path, launcher):
    from core.ports import free_port

    args, message = _case(tmp_path, DEEP_CONFIG[2], DEEP_CONFIG[3], DEEP_CONFIG[4])
    runs = tmp_path / "runs"
    if launcher == "deepspeed":
        command = launch_command("deepspeed", 2)
    else:
        command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
                   str(REPO / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", str(free_port()),
                   str(TRAIN)]
    proc = subprocess.run([*command, *args, "--runs_dir", str(runs)], cwd=REPO, env=base_env(), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode != 0
    assert proc.stderr.count(message) == 1, proc.stderr
    # no traceback from the suite's code (torchrun's agent, which accelerate launch runs, prints its own)
    ours = [line for line in (proc.stdout + proc.stderr).splitlines()
            if line.strip().startswith(f'File "{REPO}') and f"{REPO}/.venv" not in line]
    assert not ours, "\n".join(ours)
    assert not runs.exists()


def _record(runs, metrics: str) -> None:
    """A run's record (a failed run: no estimate to make) whose metrics.jsonl holds `metrics`."""
    from core.summary import RunSummary

    record = runs / "r1"
    record.mkdir(parents=True)
    (record / "summary.json").write_text(json.dumps(RunSummary(run_name="r1", status="failed", backend="single",
                                                               world_size=1, error="x").to_dict()))
    (record / "metrics.jsonl").write_text(metrics)


@pytest.mark.parametrize("metrics, message", [
    ('{"step": 0, "loss": 4.1}\n{"step": 1, "loss": \n', "metrics.jsonl line 2: not JSON (Expecting value)"),
    ('{"step": 0, "loss": 4.1}\n[1, 2]\n', "metrics.jsonl line 2: a JSON list, not an object"),
    ("[" * DEEP + "]" * DEEP + "\n", "metrics.jsonl line 1: not JSON (nested too deeply)"),
])
def test_a_report_on_a_malformed_metrics_line_is_one_line_and_writes_nothing(tmp_path, capsys, metrics, message):
    from analysis import report

    runs, out = tmp_path / "runs", tmp_path / "out"
    _record(runs, metrics)
    with pytest.raises(SystemExit) as refused:
        report.main([str(runs), "--out", str(out)])
    assert refused.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m analysis.report: error: ") and message in lines[0], lines
    assert "each line of metrics.jsonl is one JSON object" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("plan_json, message", [
    ("[1, 2]", "plan.json: a JSON list; a plan is the object analysis.plan --verify K --json writes"),
    ('{"candidates": 3}', "plan.json: its candidates or verified is not a list of objects"),
    ("[" * DEEP + "]" * DEEP, "plan.json: nested too deeply to be a plan"),
    ('{"candidates": [', "plan.json: not JSON (line 1, column 17"),
])
def test_a_replay_of_what_is_not_a_plan_is_one_line(tmp_path, capsys, plan_json, message):
    """benchmarks/plan_regret.py --replay DIR on a DIR/plan.json that is not analysis.plan's object."""
    from benchmarks import plan_regret

    (tmp_path / "plan.json").write_text(plan_json)
    assert plan_regret.main(["--replay", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plan_regret.py: error: --replay ") and message in lines[0], lines
    assert captured.out == ""


@pytest.mark.parametrize("tool", ["report", "claims", "tables"])
def test_a_report_on_no_records_is_one_line_and_writes_nothing(tmp_path, capsys, tool):
    """analysis.report, .claims and .tables on a directory holding no run record: the one line naming
    runs_dir, exit code 2, and no --out directory made."""
    import importlib

    module = importlib.import_module(f"analysis.{tool}")
    empty, out = tmp_path / "runs", tmp_path / "out"
    empty.mkdir()
    with pytest.raises(SystemExit) as refused:
        module.main([str(empty), *([] if tool == "tables" else ["--out", str(out)])])
    assert refused.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m analysis.{tool}: error: runs_dir {empty}: no run "
                                                   "records"), lines
    assert not out.exists()
