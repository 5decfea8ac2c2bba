"""ds_configs/: validation, batch arithmetic, precision, and what cannot run here (no launches)."""

import json
import re
from pathlib import Path

import pytest

from backends import deepspeed_config, deepspeed_spec
from backends.base import ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY
from conftest import REPO
from gptlite.errors import ConfigError
from core.config import DEFAULT_GRAD_CLIP, DEFAULT_LR, DEFAULT_LR_WARMUP_STEPS, RunConfig

SHIPPED = deepspeed_config.shipped_configs()
REQUIRED = {"z0", "z1", "z2", "z3", "z2_offload", "z3_infinity", "z3_infinity_nvme", "zeropp"}


def _plan(path, tmp_path=None, world=2, device=None, **flags):
    device = device or ("cuda" if "deepcompile" in Path(path).stem else "cpu")  # DeepCompile: CUDA only
    if "nvme" in Path(path).stem:
        flags.setdefault("nvme_path", str(tmp_path))
    return deepspeed_spec.spec_of(RunConfig(deepspeed_config=str(path), **flags), world, device)


def test_required_configs_are_shipped():
    assert REQUIRED <= {p.stem for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_validates(path):
    deepspeed_config.validate(str(path), deepspeed_config.read(str(path)))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_trains_like_the_torch_backends(path, tmp_path, monkeypatch):
    monkeypatch.setattr("backends.deepspeed_support.async_io_available", lambda: True)
    plan = _plan(path, tmp_path)
    assert (plan.lr, plan.lr_warmup_steps, plan.grad_clip) == (DEFAULT_LR, DEFAULT_LR_WARMUP_STEPS, DEFAULT_GRAD_CLIP)
    params = plan.config["optimizer"]["params"]
    assert plan.config["optimizer"]["type"] == "AdamW"
    assert (tuple(params["betas"]), params["eps"], params["weight_decay"]) == (ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY)
    assert plan.config["scheduler"]["params"]["warmup_type"] == "linear"
    assert plan.precision == "fp32"
    zero = plan.config["zero_optimization"]
    if tuned(path):  # tuned for speed (runs/reference/nvidia-h200/gpu_best): buckets of 5e7-5e8, overlapped
        assert zero["reduce_bucket_size"] >= 5e7 and zero["overlap_comm"] and zero["contiguous_gradients"]
        assert params["torch_adam"] is True  # torch's AdamW: no DeepSpeed op compiled before the first step
        if plan.stage in (1, 2):
            assert zero["allgather_bucket_size"] >= 5e7
        return
    if plan.stage in (1, 2):  # the article's reduced buckets, not DeepSpeed's 5e8 defaults
        assert zero["reduce_bucket_size"] <= 5e5 and zero["allgather_bucket_size"] <= 5e5 and zero["overlap_comm"]
    if plan.stage == 3:
        assert zero["reduce_bucket_size"] <= 5e5 and zero["stage3_prefetch_bucket_size"] <= 5e5


def test_deepcompile_is_refused_off_cuda_in_one_line():
    path = REPO / "ds_configs" / "z3_deepcompile.json"
    with pytest.raises(ConfigError, match=r"z3_deepcompile.json: compile.deepcompile needs a CUDA device"):
        _plan(path, device="cpu")
    assert _plan(path).config["compile"] == {"deepcompile": True}  # planned as written where CUDA is


def tuned(path) -> bool:
    return path.stem.endswith("_tuned") or "deepcompile" in path.stem


def test_whitelisted_top_level_keys_are_ones_deepspeed_reads():
    import deepspeed

    source = "\n".join(p.read_text(errors="ignore") for p in Path(deepspeed.__file__).parent.rglob("*.py"))
    missing = [k for k in deepspeed_config.KNOWN_TOP_LEVEL_KEYS if f'"{k}"' not in source and f"'{k}'" not in source]
    assert missing == []


def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    return str(path)


BASE = json.loads((REPO / "ds_configs" / "z2.json").read_text())


def _with(**changes):
    config = json.loads(json.dumps(BASE))
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = config
        for p in parents:
            target = target.setdefault(p, {})
        target[last] = value
    return config


@pytest.mark.parametrize("config, message", [
    (_with(zero_optimisation={"stage": 2}), "unknown key 'zero_optimisation', which DeepSpeed would silently ignore "
                                            "(did you mean 'zero_optimization'?)"),
    (_with(activation_checkpointing__partition_activation=True), "unknown key 'activation_checkpointing.partition_activation'"),
    (_with(optimizer__params__weight_decy=0.1), "unknown key 'optimizer.params.weight_decy'"),
    (_with(optimizer={"type": "SGD", "params": {"lr": 0.1}}), "optimizer.type must be AdamW"),
    (_with(optimizer__params__betas=[0.9, 0.95]), "optimizer.params.betas is [0.9, 0.95]; every backend uses [0.8, 0.999]"),
    (_with(scheduler__params__warmup_type="log"), "scheduler must be WarmupLR with warmup_type linear"),
    (_with(zero_optimization__overlap_com=True), "unknown key 'zero_optimization.overlap_com' (did you mean 'overlap_comm'?)"),
    (_with(bf16={"enable": True}), "unknown key 'bf16.enable' (did you mean 'enabled'?)"),
    (_with(train_batch_size=16, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1),
     "train_batch_size 16 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 1 x world size 2 (= 8)"),
    (_with(train_micro_batch_size_per_gpu=0), "train_micro_batch_size_per_gpu must be a positive integer (got 0)"),
])
def test_bad_configs_fail_in_one_line_naming_the_key(tmp_path, config, message):
    with pytest.raises(ConfigError) as e:
        _plan(_write(tmp_path, config))
    assert message in str(e.value) and "\n" not in str(e.value) and "cfg.json" in str(e.value)


def test_unreadable_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 8')  # cut off (a trailing comma is fine: DeepSpeed allows it)
    with pytest.raises(ConfigError, match=re.escape("not valid JSON (line 1")):
        deepspeed_config.read(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        deepspeed_config.read(str(bad))
    with pytest.raises(ConfigError, match="file not found"):
        deepspeed_config.read(str(tmp_path / "missing.json"))


# (file's train_batch_size, micro, gas) x (--micro_batch, --grad_accum) x world -> (micro, accum, train_batch) or error
BATCH_TABLE = [
    ((None, 8, 1), (None, None), 2, (8, 1, 16)),
    ((None, 8, 2), (None, None), 4, (8, 2, 64)),
    ((None, None, None), (None, None), 2, (8, 1, 16)),
    ((32, None, None), (None, None), 2, (16, 1, 32)),
    ((32, 4, None), (None, None), 2, (4, 4, 32)),
    ((32, None, 2), (None, None), 4, (4, 2, 32)),
    ((32, 4, 4), (None, None), 2, (4, 4, 32)),
    ((32, 4, 4), (2, None), 2, (2, 4, 16)),  # flags override; train_batch_size follows them
    ((None, 8, 1), (4, 3), 2, (4, 3, 24)),
    ((32, 4, 4), (None, None), 4, "train_batch_size 32 != train_micro_batch_size_per_gpu 4 x "
                                  "gradient_accumulation_steps 4 x world size 4 (= 64)"),
    ((30, None, None), (None, None), 4, "train_batch_size 30 is not divisible by gradient_accumulation_steps 1"),
    ((32, 3, None), (None, None), 2, "train_batch_size 32 is not divisible by train_micro_batch_size_per_gpu 3"),
]


@pytest.mark.parametrize("file_values, flags, world, expected", BATCH_TABLE)
def test_batch_arithmetic(file_values, flags, world, expected):
    config = {k: v for k, v in zip(("train_batch_size", "train_micro_batch_size_per_gpu",
                                    "gradient_accumulation_steps"), file_values) if v is not None}
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=re.escape(expected)):
            deepspeed_spec.batch_sizes(config, *flags, world, "cfg.json")
    else:
        assert deepspeed_spec.batch_sizes(config, *flags, world, "cfg.json") == expected
        micro, accum, train_batch = expected
        assert micro * accum * world == train_batch


def test_flags_override_the_file_and_the_file_fills_in_the_rest(tmp_path):
    path = _write(tmp_path, _with(bf16={"enabled": True}, optimizer__params__lr=5e-4, scheduler__params__warmup_num_steps=7,
                                  gradient_clipping=0.5))
    plan = _plan(path)
    assert (plan.precision, plan.lr, plan.lr_warmup_steps, plan.grad_clip) == ("bf16", 5e-4, 7, 0.5)
    assert plan.config["scheduler"]["params"]["warmup_max_lr"] == 5e-4
    plan = _plan(path, precision="fp32", lr=2e-3, lr_warmup_steps=0, grad_clip=0.0)
    assert (plan.precision, plan.lr, plan.lr_warmup_steps, plan.grad_clip) == ("fp32", 2e-3, 0, 0.0)
    assert plan.config["bf16"]["enabled"] is False and "scheduler" not in plan.config  # no warm-up: constant lr
    assert plan.config["gradient_clipping"] == 0.0


def test_clipping_is_explicit_because_deepspeed_clips_by_default(tmp_path):
    config = _with()
    del config["gradient_clipping"]
    plan = _plan(_write(tmp_path, config))
    assert plan.config["gradient_clipping"] == 1.0 == DEFAULT_GRAD_CLIP  # DeepSpeed 0.19's own default


def test_nvme_needs_a_directory_and_libaio(tmp_path, monkeypatch):
    nvme = REPO / "ds_configs" / "z3_infinity_nvme.json"
    monkeypatch.setattr("backends.deepspeed_support.async_io_available", lambda: True)
    with pytest.raises(ConfigError, match="pass --nvme_path DIR"):
        deepspeed_spec.spec_of(RunConfig(deepspeed_config=str(nvme)), 2, "cpu")
    plan = _plan(nvme, tmp_path)
    zero = plan.config["zero_optimization"]
    assert zero["offload_param"]["nvme_path"] == zero["offload_optimizer"]["nvme_path"] == str(tmp_path)
    monkeypatch.setattr("backends.deepspeed_support.async_io_available", lambda: False)
    with pytest.raises(ConfigError, match="needs DeepSpeed's async_io op.*libaio.*apt-get install libaio-dev"):
        _plan(nvme, tmp_path)


def test_zeropp_quantization_is_switched_off_on_cpu_only_with_a_note():
    zeropp = REPO / "ds_configs" / "zeropp.json"
    on_cpu = _plan(zeropp)
    zero = on_cpu.config["zero_optimization"]
    assert zero["zero_hpz_partition_size"] == 2
    assert zero["zero_quantized_weights"] is False and zero["zero_quantized_gradients"] is False
    assert len(on_cpu.notes) == 2 and all("not applied" in n for n in on_cpu.notes)
    on_gpu = _plan(zeropp, device="cuda")
    assert on_gpu.config["zero_optimization"]["zero_quantized_weights"] is True and on_gpu.notes == []


def test_checkpointing_options(tmp_path):
    z3 = REPO / "ds_configs" / "z3.json"
    with pytest.raises(ConfigError, match="deepspeed_nonreentrant fails under ZeRO stage 3"):
        _plan(z3, ckpt_interval=1, ckpt_impl="deepspeed_nonreentrant")
    plan = _plan(z3, ckpt_interval=2, ckpt_impl="deepspeed", ckpt_offload=True)
    section = plan.config["activation_checkpointing"]
    assert section["cpu_checkpointing"] is True and section["partition_activations"] is True


def test_a_config_is_read_as_deepspeed_reads_it(tmp_path):
    """Comments and trailing commas, which DeepSpeed's hjson reader accepts, are accepted too."""
    plain = REPO / "ds_configs" / "z2.json"
    text = plain.read_text().replace('"gradient_clipping": 1.0,', '// clip like DeepSpeed\n  "gradient_clipping": 1.0,')
    text = text.replace('"overlap_comm": true,', '"overlap_comm": true,  // overlap the reductions')
    relaxed = tmp_path / "z2.json"
    relaxed.write_text(text.rstrip().rstrip("}").rstrip() + ",\n}\n")  # a trailing comma too
    assert "//" in relaxed.read_text()
    assert deepspeed_config.read(str(relaxed)) == deepspeed_config.read(str(plain))


@pytest.mark.parametrize("path", [p for p in SHIPPED if "nvme" not in p.stem], ids=lambda p: p.stem)
def test_a_config_given_inline_as_base64_plans_as_its_file_does(path):
    # deepspeed.initialize takes a --deepspeed_config that is no file as base64-encoded JSON; its
    # autotuner passes configs so. The text is the file's, so the plan must be the file's.
    import base64

    encoded = base64.urlsafe_b64encode(path.read_bytes()).decode()
    assert deepspeed_config.inline(str(path)) is None
    device = "cuda" if "deepcompile" in path.stem else "cpu"
    assert deepspeed_spec.spec_of(RunConfig(deepspeed_config=encoded), 2, device).config == _plan(path).config
    from analysis.runs import config_label
    assert config_label("deepspeed", None, encoded) == "deepspeed.inline"
    assert config_label("deepspeed", None, str(path)) == f"deepspeed.{path.stem}"
