"""A sweep's runs checked before the first starts: each resolved as train.py will resolve it, its model
and data loaded once, its --ckpt_policy auto planned. torch and the run's checks load here, not in
orchestration/sweep.py, which a Slurm job's wrapper imports to unpickle its run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

import backends
import training.run
from core.dist import DistEnv
from estimator.checkpointing_plan import plan_for_record
from gptlite.data import DataError
from gptlite.errors import ConfigError, one_line
from orchestration.launch import launcher_for
from orchestration.sweep import MODEL_FLAGS, SweepRun
from training.cli import config_from_argv
from training.preflight import writable_out


def check_runs(runs: list[SweepRun], directory: Path, planner=None) -> None:
    """Every planned run resolved as train.py will resolve it (flags, config files, world size, and
    its model and data: training/run.py check_model, each distinct model once), before the first
    starts: a bad spec is refused whole (ConfigError naming the run). Each `auto:<GiB>` run is planned
    too (by `planner`, else the estimator's, estimator/checkpointing_plan.plan_for_record), on counted costs
    (whether a plan fits does not depend on them): a budget no plan fits is refused here, naming the
    smallest budget a plan fits, rather than when its turn comes."""
    # the sweep's records and logs: beside other records, never inside one, and where they can be written
    writable_out("runs_dir", str(directory))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    checked: dict[str, object] = {}  # each distinct model's workload, checked once
    for run in runs:
        nvme = dict(run.flags).get("nvme_path")
        if nvme:  # scratch space the sweep owns, for ZeRO-Infinity's NVMe offload
            Path(nvme).mkdir(parents=True, exist_ok=True)
        try:
            cfg = config_from_argv(run.argv(directory))
            env = DistEnv(0, 0, run.world_size, run.world_size, device, launcher_for(run.backend))
            cfg = backends.resolve(cfg, env).cfg
            model = json.dumps({name: getattr(cfg, name) for name in MODEL_FLAGS})
            if model not in checked:
                checked[model] = _check_model(cfg)
            # Each run: its backend or flags may need blocks the model does not have (fsdp, not ddp).
            training.run.check_blocks(checked[model], cfg)
            if cfg.ckpt_policy == "auto":
                plans = planner or plan_for_record
                # A description (dry run, no name): a run recorded before may be planned again.
                training.run.prepare_run(dataclasses.replace(cfg, dry_run=True, run_name=None), env,
                                         planner=lambda *a, **k: plans(*a, **{**k, "measure": False}), workload=checked[model])
        except (ConfigError, DataError) as e:
            raise ConfigError(f"run {run.name}: {e}") from None


def _check_model(cfg):
    try:
        return training.run.check_model(cfg)
    except (ConfigError, DataError):
        raise
    except Exception as e:  # noqa: BLE001 - the model's own code failed (get_model raising): so would the run
        raise ConfigError(f"model {cfg.model}: {one_line(e)}") from None
