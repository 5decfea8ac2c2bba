"""fsdp_configs/: every shipped file validates; bad files and bad flag combinations fail in one line."""

import dataclasses
import re

import pytest
import torch
import yaml

import backends
from backends import fsdp_config
from backends.fsdp import FSDPBackend
from conftest import REPO
from gptlite.errors import ConfigError
from core.config import RunConfig
from core.dist import DistEnv

SHIPPED = fsdp_config.shipped_configs()
REQUIRED = {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "full_shard_offload", "full_shard_bf16"}


def test_required_configs_are_shipped():
    assert REQUIRED <= {p.stem for p in SHIPPED}
    assert any(fsdp_config.load(str(p)).backend == "fsdp2" for p in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    options = fsdp_config.load(str(path))
    assert options.backend in ("fsdp", "fsdp2")
    # Each shipped file spells out every option, so what it does is visible in the file itself.
    spelled_out = set(yaml.safe_load(path.read_text()))
    # The hybrid family's keys are spelled out in its own files; the files from before them keep their
    # bytes (the planner's shipped costs are keyed by them: analysis/plan/shipped_costs.json).
    hybrid = {"hybrid_shard_size", "shard_within_node", "mesh"}
    assert spelled_out >= {f.name for f in dataclasses.fields(options)} - hybrid


def _write(tmp_path, text) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, message", [
    ("sharding_strategy: FULL_SHARDD\n", "sharding_strategy must be one of FULL_SHARD"),
    ("shardng_strategy: FULL_SHARD\n", "unknown key 'shardng_strategy'"),
    ("cpu_offload: 'yes'\n", "cpu_offload must be true or false"),
    ("mixed_precision:\n  param_dtype: fp8\n", "mixed_precision.param_dtype must be one of fp32, bf16, fp16"),
    ("mixed_precision:\n  param_dtpye: bf16\n", "unknown key 'mixed_precision.param_dtpye'"),
    ("backward_prefetch: SOMETIMES\n", "backward_prefetch must be one of"),
    ("sharding_strategy: HYBRID_SHARD\nhybrid_shard_size: 1\n", "hybrid_shard_size must be >= 2"),
    ("hybrid_shard_size: 2\n", "hybrid_shard_size applies only to sharding_strategy HYBRID_SHARD"),
    ("backend: fsdp3\n", "backend must be one of fsdp, fsdp2"),
    ("backend: fsdp2\nsharding_strategy: FULL_SHARD\n", "unknown key 'sharding_strategy'"),
    ("sharding_strategy: FULL_SHARD\n  use_orig_params: true\n", "not valid YAML (line 2"),
    ("- FULL_SHARD\n", "must be a mapping"),
])
def test_bad_config_files_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        fsdp_config.load(_write(tmp_path, text))
    assert "\n" not in str(e.value) and "cfg.yaml" in str(e.value)


def test_hybrid_shard_size_must_divide_the_world(tmp_path):
    path = _write(tmp_path, "sharding_strategy: HYBRID_SHARD\nhybrid_shard_size: 4\n")
    env = DistEnv(rank=0, local_rank=0, world_size=6, local_world_size=6, device=torch.device("cpu"),
                  launcher="torchrun")
    with pytest.raises(ConfigError, match="hybrid_shard_size 4 must be >= 2 and divide the world size 6"):
        FSDPBackend.resolve(RunConfig(fsdp_config=path), env)


def test_precision_comes_from_the_file_unless_the_flag_overrides_it():
    env = DistEnv(0, 0, 2, 2, torch.device("cpu"), "torchrun")
    bf16 = str(REPO / "fsdp_configs" / "full_shard_bf16.yaml")
    assert FSDPBackend.resolve(RunConfig(fsdp_config=bf16), env).cfg.precision == "bf16"
    assert FSDPBackend.resolve(RunConfig(fsdp_config=bf16, precision="fp32"), env).cfg.precision == "fp32"
    full = str(REPO / "fsdp_configs" / "full_shard.yaml")
    assert FSDPBackend.resolve(RunConfig(fsdp_config=full), env).cfg.precision == "fp32"
    options = fsdp_config.options_for(RunConfig(fsdp_config=full, precision="bf16"), "fsdp")
    assert (options.mixed_precision.param_dtype, options.mixed_precision.reduce_dtype) == ("bf16", "fp32")


def test_the_backend_is_inferred_from_the_config_file():
    env = DistEnv(0, 0, 2, 2, torch.device("cpu"), "torchrun")
    fsdp2 = backends.resolve(RunConfig(fsdp_config=str(REPO / "fsdp_configs" / "fsdp2.yaml")), env)
    assert fsdp2.cfg.backend == "fsdp2" and fsdp2.backend.name == "fsdp2" and fsdp2.spec.reshard_after_forward
    fsdp = backends.resolve(RunConfig(fsdp_config=str(REPO / "fsdp_configs" / "no_shard.yaml")), env)
    assert fsdp.cfg.backend == "fsdp" and fsdp.spec.sharding_strategy == "NO_SHARD"
