"""The run train.py's flags describe, on a world of any size, without launching it: one resolution
for every tool that speaks about a run (analysis.estimate_cli, analysis.project, analysis.plan,
simulation.fake_world).

`describe(train_argv, world=W)` reads the flags exactly as train.py does (training/cli.py: the same
names, defaults and checks), resolves them exactly as a run does (training/run.prepare_run, hence
`backends.resolve`: the backend, its config file, `--precision` applied to an FSDP file's mixed
precision, the batch layout, `--ckpt_policy auto`'s plan) as rank 0 of W ranks, and returns what
`train.py --dry_run` prints under a launcher of W ranks: config.json's description of the run, plus
the device. A tool that starts from it cannot disagree with the run it describes
(tests/unit/test_describe.py holds each tool to `train.py --dry_run`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from core.dist import DistEnv
from gptlite.errors import ConfigError
from training.cli import config_from_argv
from training.run import prepare_run

DEVICES = ("auto", "cpu", "cuda")
# The RunConfig fields that choose the model and its data (RunConfig.model_request).
MODEL_FIELDS = ("model", "model_name_or_path", "model_args", "preset", "n_layer", "n_embd", "n_head", "block_size", "dropout", "attention",
                "data", "seed")
_WORKLOADS: dict[tuple, object] = {}


def simulated_env(world: int = 1, ranks_per_node: int | None = None, device: str = "auto") -> DistEnv:
    """Rank 0 of `world` ranks, `ranks_per_node` to a node (default: all on one), on `device`: a
    description, not a process group. `cuda` is accepted where CUDA is not (a GPU run described
    from a laptop); `auto` is this machine's."""
    for name, value in (("world", world), ("gpus_per_node", ranks_per_node)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be an integer >= 1 (got {value!r})")
    per_node = ranks_per_node or world
    if world % per_node and world > per_node:
        raise ConfigError(f"gpus_per_node {per_node} must divide world {world} (whole nodes)")
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)} (got {device!r})")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return DistEnv(0, 0, world, min(per_node, world), torch.device(device, 0) if device == "cuda"
                   else torch.device("cpu"), "python" if world == 1 else "env")


def resolve_flags(train_argv: Sequence[str], world: int = 1, ranks_per_node: int | None = None,
                  planner: Callable | None = None):
    """training.run.Setup of train.py's flags `train_argv` as rank 0 of `world` ranks would resolve
    them (`--dry_run`: nothing built, checked against this machine or recorded). Raises
    ConfigError/DataError with train.py's own one-line reasons."""
    return resolve_config(config_from_argv([*train_argv]), world, ranks_per_node, planner)


def resolve_config(cfg, world: int = 1, ranks_per_node: int | None = None, planner: Callable | None = None):
    """resolve_flags of a RunConfig already parsed (the planner's candidates: one model's flags
    parsed once, each candidate's choices set by dataclasses.replace)."""
    cfg = dataclasses.replace(cfg, dry_run=True)
    env = simulated_env(world, ranks_per_node, cfg.device)
    # One model is described under many configurations and worlds (analysis.project): loaded and
    # checked once.
    key = tuple(getattr(cfg, name) for name in MODEL_FIELDS)
    setup = prepare_run(cfg, env=env, planner=planner, workload=_WORKLOADS.get(key))
    _WORKLOADS[key] = setup.workload
    return setup


def describe(train_argv: Sequence[str], world: int = 1, ranks_per_node: int | None = None,
             planner: Callable | None = None) -> dict:
    """config.json's description of the run `train_argv` names on `world` ranks (what `train.py
    --dry_run` prints for rank 0 of that world), with `environment.device`: what analysis.estimate_cli's
    estimate_from_record and the other tools read. `planner`: --ckpt_policy auto's (default: the
    estimator's, as the run's own)."""
    setup = resolve_flags(train_argv, world, ranks_per_node, planner)
    return {**setup.record(), "environment": {"device": str(setup.env.device)}}
