"""A run from its configuration: everything checkable before any process group, then its life.

`prepare_run` checks the configuration, the backend's plan, the data and the injected fault before
anything starts (bad input: one line, exit code 2, nothing recorded) and returns the Setup;
`main` then hands it to `Run.execute` (training/lifecycle.py), which creates the process group and
the record, trains, and records the outcome.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import backends
from backends.base import Resolved
from core.blocks import find_blocks
from core.config import RunConfig, describe_plan, plan_choices_under
from core.dist import DistEnv
from core.faults import Fault
from core.sdpa import check_device
import models
from gptlite.data import DataError
from gptlite.errors import ConfigError
from models import Workload
from estimator.checkpointing_plan import plan_for_record
from training import manifest, memory_check, preflight, trackers
from training.cli import report_bad_input
from training.lifecycle import EXIT_INTERRUPTED, EXIT_OK, Run
from training.locks import RecordLock
from training.setup import Setup


def prepare_run(cfg: RunConfig, env: DistEnv | None = None, resolved: Resolved | None = None,
                planner: Callable | None = None, workload: Workload | None = None) -> Setup:
    """Everything that can be checked before any process group exists. Raises ConfigError/DataError.

    `resolved`: the backend already resolved (tests pass their own backend this way). `planner`: what
    --ckpt_policy auto plans with (planned_checkpointing). `workload`: the run's model, already loaded and
    checked (check_model)."""
    env = env or DistEnv.from_environment(cfg.device)
    resolved = resolved or backends.resolve(cfg, env)
    cfg = resolved.cfg
    if cfg.init_from is not None and not Path(cfg.init_from).is_file():
        raise ConfigError(f"init_from: file not found: {cfg.init_from}")
    fault = Fault.from_environment(cfg.backend, env.rank)  # a malformed GPTLITE_FAULT is bad input
    workload = check_model(cfg, workload)
    setup = Setup(resolved, env, workload, fault)
    if cfg.ckpt_policy == "auto":
        setup.resolved = resolved = planned_checkpointing(setup, planner)
        cfg = resolved.cfg
    if cfg.dry_run:  # a description (train.py --dry_run, and every tool's): no record, checkpoint or lock read
        return setup
    check_device(cfg.sdpa_kernel, env.device.type, cfg.model_dropout())
    if (cfg.run_name is not None and not cfg.overwrite and not cfg.resume
            and (Path(cfg.runs_dir) / cfg.run_name).exists()):
        raise ConfigError(f"run_name: {Path(cfg.runs_dir) / cfg.run_name} already exists "
                          "(choose another --run_name, pass --overwrite, or --resume it)")
    # Before anything is built or recorded (a dry run builds nothing: it may describe a run meant
    # for a bigger machine).
    # A checkpoint FSDP2 or ZeRO-3 loads shard by shard is never whole on a rank (Backend.build_model).
    if workload.pretrained is None or not resolved.backend.loads_checkpoint_sharded(resolved.spec):
        memory_check.check_model_fits(cfg, env, workload.meta())
    if env.is_main:  # only rank 0 logs to trackers
        trackers.check(cfg.tracker)
    preflight.writable_out("runs_dir", cfg.runs_dir)  # records beside records, never inside one or a checkpoint
    for where, path in resolved.backend.output_dirs(cfg, resolved.spec):  # DeepSpeed's monitors, where the file says
        preflight.writable_dir(where, path)
    record_dir = Path(cfg.runs_dir) / cfg.run_name if cfg.run_name else None
    if cfg.save_dir:
        preflight.writable_dir("save_dir", cfg.save_dir)
        preflight.outside_records(cfg.save_dir, record_dir)
    if cfg.init_from:
        setup.init = preflight.init_weights(cfg.init_from, workload, cfg.trust_checkpoint)
        if setup.init["step"] + 1 >= cfg.steps:
            raise ConfigError(f"init_from: {cfg.init_from} ends at step {setup.init['step']}; with --steps "
                              f"{cfg.steps} there is nothing left to train; ask for more --steps")
    if cfg.resume:
        setup.resume = preflight.resume_point(cfg, env.world_size, setup.layout.global_batch, workload, record_dir,
                                              resolved.backend.checkpoint_format)
        setup.run_id = preflight.recorded_run_id(record_dir) or setup.run_id
        if setup.resume is not None and not setup.resume.shapes_checked and env.is_main:
            print(f"note: {setup.resume.directory} was written before checkpoints recorded their parameter shapes "
                  "and its format does not say them: they are compared only as it loads", file=sys.stderr)
        if setup.resume is not None and not setup.resume.verified and env.is_main:  # --trust_checkpoint
            note = manifest.trusted_note(setup.resume.directory, setup.resume.meta["format"])
            if note:
                print(note, file=sys.stderr)
    if record_dir is not None and record_dir.is_dir() and setup.resume is None and (cfg.overwrite or cfg.resume):
        preflight.replaceable(record_dir)
    if env.is_main:  # last: every other check has passed
        try:
            if cfg.run_name:
                setup.lock = RecordLock(cfg.runs_dir, cfg.run_name)
            if cfg.save_every or cfg.resume:
                # Decided holding the directory's lock, so no other run can claim it meanwhile.
                setup.save_lock = preflight.SaveDirLock(cfg.save_dir)
                preflight.own_save_dir(cfg.save_dir, setup.run_id, cfg.run_name, record_dir)
            if cfg.save_every:
                manifest.signing_key()  # made (or found unusable) now, not at the first save
            for path in resolved.backend.swap_dirs(resolved.spec):
                setup.nvme_locks.append(preflight.NVMeLock(path))
        except ConfigError:
            for lock in (setup.lock, setup.save_lock, *setup.nvme_locks):
                if lock is not None:
                    lock.release()
            raise
    return setup


def planned_checkpointing(setup: Setup, planner: Callable | None) -> Resolved:
    """--ckpt_policy auto: the run with the plan that fits --mem_budget_gb as its --ckpt_plan, printed.
    The plan comes from the memory estimator (the estimator layer, below training: `planner(config,
    budget_gb, workload, choices)`, estimator/checkpointing_plan.plan_for_record unless a caller hands in its own,
    as analysis.estimate_cli does to print the plan). With --ckpt_cost measured rank 0 times the recompute;
    the plan each rank runs is rank 0's (Run.agree_on_plan). Raises ConfigError naming the smallest budget
    a plan fits."""
    cfg = setup.cfg
    if cfg.ckpt_plan is not None:
        raise ConfigError("ckpt_plan is what --ckpt_policy auto decides: give one or the other")
    recorded = (preflight.recorded_config(Path(cfg.runs_dir) / cfg.run_name) or {}).get("run") or {} \
        if cfg.resume and cfg.run_name else {}
    if (recorded.get("ckpt_policy"), recorded.get("mem_budget_gb")) == ("auto", cfg.mem_budget_gb) \
            and recorded.get("ckpt_plan"):
        # A resumed run keeps the plan it started with (a micro-batch changed on resume, another
        # world size or another estimator may plan otherwise; the record holds one run's settings).
        if setup.env.is_main and not cfg.quiet and not cfg.dry_run:
            print(f"ckpt_policy auto, mem_budget_gb {cfg.mem_budget_gb:g}: the plan the run started with, "
                  f"{describe_plan(recorded['ckpt_plan'].split(','))}", flush=True)
        return dataclasses.replace(setup.resolved, cfg=dataclasses.replace(cfg, ckpt_plan=recorded["ckpt_plan"]))
    planner = planner or plan_for_record
    config = {**setup.record(), "environment": {"device": str(setup.env.device)}}
    choices = plan_choices_under(((config.get("plan") or {}).get("config") or {}).get("zero_optimization", {}).get("stage"))
    if cfg.ckpt_save_ops is not None and "selective" not in choices:
        raise ConfigError("ckpt_save_ops names what selective blocks keep, and under ZeRO stage 3 --ckpt_policy auto "
                          "plans with none and full only: drop --ckpt_save_ops")
    # A measured cost is rank 0's alone: the other ranks take its plan once the process group exists
    # (Run.agree_on_plan), so that every rank checkpoints the same blocks.
    chosen = planner(config, cfg.mem_budget_gb, setup.workload, choices, measure=setup.env.is_main)
    if setup.env.is_main and not cfg.quiet and not cfg.dry_run:
        print(f"ckpt_policy auto, mem_budget_gb {cfg.mem_budget_gb:g}: {describe_plan(chosen.choices)} (estimated peak "
              f"{chosen.peak_bytes / 2**30:.3f} GiB, {chosen.describe_cost()})", flush=True)
    return dataclasses.replace(setup.resolved, cfg=dataclasses.replace(cfg, ckpt_plan=",".join(chosen.choices)))


def check_model(cfg: RunConfig, workload: Workload | None = None) -> Workload:
    """The run's model and data, loaded and checked together (models.Workload.check: a few samples,
    one forward and loss on the meta device) and its blocks found where the backend or a flag needs
    them, without building anything: part of `prepare_run`, and what sweep.py checks for each model of a
    matrix before its first run. `cfg` is resolved (its backend named); `workload`, the same model already
    loaded and checked (simulation/describe.py resolves one model under many configurations), is checked
    only for the blocks this run needs. Raises ConfigError/DataError."""
    if workload is None:
        workload = models.load(cfg.model_request())
        workload.check()
    check_blocks(workload, cfg)
    return workload


def check_blocks(workload: Workload, cfg: RunConfig) -> None:
    """The model's blocks are found where the run needs them (Backend.blocks_needed_by: FSDP's units,
    checkpointing, --compile); a model without any trains where nothing does (single, ddp, ZeRO)."""
    needed_by = backends.get_backend(cfg.backend or backends.REFERENCE).blocks_needed_by(cfg)
    blocks = find_blocks(workload.meta(), cfg.block_class, needed_by)
    if cfg.ckpt_plan is not None:
        cfg.ckpt_choices(len(blocks))  # one entry per block
    check_unused(workload, cfg)


def check_unused(workload: Workload, cfg: RunConfig) -> None:
    """A model that leaves parameters without a gradient (Workload.unused_parameters: conditional computation)
    trains with one process's semantics, a parameter no sample used gets no update, only in one process and
    under DDP with --find_unused_parameters (a parameter no rank used keeps no gradient, and AdamW skips it).
    Without the flag DDP stops at the next step waiting for the missing gradients; FSDP turns them into zero
    gradients that AdamW still moves (a silent drift: 3e-4 in the loss by step 10 on a top-1 mixture of
    experts), FSDP2 and DeepSpeed ZeRO abort on mismatched collectives when the ranks' unused parameters
    differ. Refused before anything runs (ConfigError)."""
    unused = workload.unused_parameters
    if not unused:
        return
    names = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
    what = (f"model {workload.name} leaves parameters without a gradient on its first 2 training samples ({names}: "
            "conditional computation, such as experts that get no token or an unused parameter)")
    backends.get_backend(cfg.backend or backends.REFERENCE).check_unused_parameters(cfg, what)


def main(cfg: RunConfig, planner: Callable | None = None) -> int:
    """Run `cfg`; `planner`: what --ckpt_policy auto plans with (default: the estimator's)."""
    try:
        setup = prepare_run(cfg, planner=planner)
    except (ConfigError, DataError) as e:
        return report_bad_input(f"train.py: error: {e}")
    except KeyboardInterrupt:  # Ctrl-C while checking or planning (--ckpt_policy auto measures costs): nothing recorded
        print("train.py: interrupted (Ctrl-C) before training started; nothing was recorded", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if cfg.dry_run:
        if setup.env.is_main:
            print(json.dumps(setup.record(), indent=2))
        return EXIT_OK
    return Run(setup).execute()


