"""sweep.py's command line: a sweep spec run here or on Slurm, --status, --cancel, and the largest-batch
search (--max_batch). sweep.py at the top of the repository is the thin file users run."""


from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import shlex
import sys
import textwrap

import torch

from core.config import tracker_names
from gptlite.errors import ConfigError
from orchestration.executors import executor_for
from orchestration.max_batch import SearchError, search, write_results
from orchestration.runner import Runner, Stopped, stop_on_sigterm
from orchestration.slurm import FLAGS, add_flags, read_jobs, settings_from
from orchestration.checks import check_runs
from orchestration.sweep import expand, load_spec
from training.cli import OneLineParser
from training.progress import runs_bar

# sweep.py's description, the first line of its --help.
DESCRIPTION = "Run a matrix of training runs from a YAML spec, one at a time, through the real launchers."

EPILOG = textwrap.dedent("""\
    A spec (see sweeps/README.md) is a matrix over backend configs (single, ddp, fsdp_configs/*.yaml,
    ds_configs/*.json), ckpt_interval, ckpt_impl, micro_batch, precision, world_size and preset,
    plus train.py flags shared by every run (train_args). Records go to runs/sweeps/<name>/ (or the
    spec's runs_dir); each run's launcher output to <that>/.logs/<run>.log. A failed, out-of-memory
    or timed-out run is recorded with that status and the sweep goes on; running the spec again
    skips runs already done (--retry_failed reruns failed and timed-out ones). One sweep at a time
    per directory; a run another process is writing is left alone.

    --executor slurm submits each run as a Slurm job (one job array per resource shape) running the
    same launcher command on its node, with the spec's executor: section (partition, account,
    time_min, nodes, gpus_per_node, cpus_per_task, array_parallelism, signal_delay_s, max_requeues,
    sbatch, setup; the flags below override it), then follows the jobs to their end. The runs
    directory must be shared with the nodes. A job stopped at its time limit is recorded timeout;
    with save_every in train_args it is requeued and continues from its checkpoint. Ctrl-C leaves
    the jobs running: --status and --cancel find them again (orchestration/slurm.py).""")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="sweep.py", description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="sweep spec (YAML), e.g. sweeps/cpu_quick.yaml")
    p.add_argument("--dry_run", action="store_true", help="list the planned runs and their commands; run nothing")
    p.add_argument("--retry_failed", action="store_true", help="rerun runs recorded as failed or timed out")
    p.add_argument("--max_batch", action="store_true",
                   help="for each configuration of the matrix (micro_batch ignored), find the largest "
                        "micro-batch that fits, by doubling then bisection, and measure its throughput")
    p.add_argument("--mem_budget_gb", type=float, default=None,
                   help="memory budget per rank for --max_batch, GiB (required on CPU; on CUDA default: the device)")
    p.add_argument("--max_micro_batch", type=int, default=4096, help="upper bound of the --max_batch search")
    p.add_argument("--probe_steps", type=int, default=3, help="steps of each --max_batch probe run")
    p.add_argument("--tracker", action="append", metavar="{tensorboard,wandb,csv}",
                   help="log every run to this experiment tracker too (train.py's --tracker; repeatable; added to the "
                        "spec's train_args.tracker). A run already recorded is not rerun for it (docs/trackers.md)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object at the end (the runs: each one's status and record; with --dry_run "
                        "their commands; with --status their states); every other line goes to stderr")
    g = add_flags(p)
    g.add_argument("--status", action="store_true",
                   help="list every run as queued, running, ok, failed, oom, timeout, cancelled, dead (its record "
                        "says running but its process is gone) or not submitted")
    g.add_argument("--cancel", action="store_true",
                   help="cancel the sweep's queued and running jobs and record those runs as cancelled")
    g.add_argument("--no_wait", action="store_true", help="submit and return; follow with --status")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.result = None  # what --json prints
    if not args.json:
        return _main(args)
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        code = _main(args)
    if args.result is not None:
        print(json.dumps(args.result), file=stdout, flush=True)
    return code


def _main(args) -> int:
    try:
        spec = load_spec(args.spec)
        if args.tracker:
            spec.train_args["tracker"] = tracker_names([*filter(None, [spec.train_args.get("tracker")]), *args.tracker])
        runs, skipped = expand(spec)
        if args.mem_budget_gb is not None and not args.max_batch:
            raise ConfigError("--mem_budget_gb is --max_batch's budget: give --max_batch too")
        if args.executor == "local" and not (args.status or args.cancel or args.no_wait):
            given = next((name for name, _, _ in FLAGS if getattr(args, name, None) is not None), None)
            if given:
                raise ConfigError(f"--{given} is a Slurm setting: it needs --executor slurm")
        if args.max_batch:
            _check_max_batch_args(args)
            if any(dict(run.flags).get("ckpt_policy") == "auto" for run in runs):
                raise ConfigError("--max_batch with matrix.ckpt_policy auto:<GiB>: the search's budget would replace "
                                  "the plan's; search the hand-set policies, or plan each micro-batch with auto")
        if args.executor == "slurm" or args.status or args.cancel:
            if args.max_batch:
                raise ConfigError("--max_batch runs its probes one after another, here: use --executor local")
            return _on_slurm(args, spec, runs, skipped)
        check_runs(runs, spec.directory)
        if args.max_batch:  # a search: its probes through a runner of their own
            runner = Runner(_max_batch_dir(spec, args), spec.timeout_s, retry_failed=args.retry_failed)
            if not args.dry_run:
                runner.hold_directory()  # one sweep per directory: refused here if another has it
        else:
            executor = executor_for(spec.name, spec.directory, spec.timeout_s, runs, retry_failed=args.retry_failed)
            if not args.dry_run:
                executor.hold_directory()
            executor.check()
    except ConfigError as e:
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    for reason in skipped:  # combinations of the matrix that cannot run, said, never silently dropped
        print(f"left out: {reason}")
    if args.dry_run:
        for run in runs:
            print(f"{run.name}\n    {shlex.join(run.command(spec.directory))}")
        print(f"{len(runs)} runs into {spec.directory}")
        args.result = _planned(spec, runs, skipped)
        return 0
    stop_on_sigterm()
    try:
        if args.max_batch:
            return _max_batch(args, spec, runs, runner)
        return _finished(args, spec, executor.run_all(lambda line: print(line, flush=True)))
    except ConfigError as e:  # a record made with other settings, met during the search
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped) as e:
        print(f"sweep.py: stopped ({type(e).__name__}); the run in progress was stopped and recorded as failed",
              file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143


def _on_slurm(args, spec, runs, skipped) -> int:
    """--executor slurm, --status, --cancel (orchestration/slurm.py). ConfigError: bad input, nothing submitted."""
    sweep = executor_for(spec.name, spec.directory, spec.timeout_s, runs, settings_from(spec.executor, args),
                         retry_failed=args.retry_failed)
    if args.status:
        if read_jobs(spec.directory):  # a local sweep's records need no Slurm to be read
            sweep.check_tools()
        rows = sweep.status()
        width = max((len(r[0]) for r in rows), default=10)
        for name, state, job_id, detail in rows:
            print(f"{name:<{width}}  {state:<13} {('job ' + job_id) if job_id else '':<12} {detail[:120]}")
        counts = collections.Counter(state for _, state, _, _ in rows)
        print(f"{spec.name}: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
        args.result = {"name": spec.name, "directory": str(spec.directory), "counts": dict(counts),
                       "runs": [{"name": n, "state": s, "job_id": j, "detail": d} for n, s, j, d in rows]}
        return 0
    if args.cancel:
        sweep.check_tools()
        sweep.cancel(print)
        return 0
    check_runs(runs, spec.directory)
    sweep.check()
    if args.dry_run:
        for reason in skipped:
            print(f"left out: {reason}")
        for run in runs:
            print(f"{run.name}  [{sweep.shapes()[run.name]}]\n    {shlex.join(run.command(spec.directory))}")
        print(f"{len(runs)} runs, one Slurm job each, into {spec.directory}")
        args.result = _planned(spec, runs, skipped)
        return 0
    sweep.hold_directory()  # one submitting sweep per directory
    for reason in skipped:
        print(f"left out: {reason}")
    try:
        outcomes = sweep.run_all(lambda line: print(line, flush=True), follow=not args.no_wait)
    except KeyboardInterrupt:
        print(f"sweep.py: stopped following; the jobs go on: python sweep.py {args.spec} --status (or --cancel)",
              file=sys.stderr)
        return 130
    if outcomes is None:
        print(f"follow them with: python sweep.py {args.spec} --status")
        return 0
    return _finished(args, spec, outcomes)


def _planned(spec, runs, skipped) -> dict:
    """--dry_run --json: the runs a sweep would make and their commands."""
    return {"name": spec.name, "directory": str(spec.directory), "left_out": list(skipped),
            "runs": [{"name": run.name, "command": run.command(spec.directory)} for run in runs]}


def _finished(args, spec, outcomes: list) -> int:
    """The sweep's last line (its runs' statuses, counted; --json's object) and its exit code."""
    counts = collections.Counter(o.status for o in outcomes)
    print(f"{spec.name}: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
          + f"; records in {spec.directory}")
    args.result = {"name": spec.name, "directory": str(spec.directory), "counts": dict(counts), "runs": [
        {"name": o.run.name, "status": o.status, "record": str(spec.directory / o.run.name),
         "samples_per_s": o.summary.samples_per_s if o.summary else None,
         "error": o.summary.error if o.summary else None} for o in outcomes]}
    return _exit_code(counts)


def _exit_code(counts: collections.Counter) -> int:
    """1 when a run of the sweep did not end as it should (an oom is a finding, not a failure)."""
    return 1 if counts["failed"] or counts["timeout"] or counts["left alone"] or counts["cancelled"] else 0


def _check_max_batch_args(args) -> None:
    if args.mem_budget_gb is None and not torch.cuda.is_available():
        raise ConfigError("--max_batch on CPU needs --mem_budget_gb (the CPU has no device memory limit)")
    if args.mem_budget_gb is not None and not (math.isfinite(args.mem_budget_gb) and args.mem_budget_gb > 0):
        raise ConfigError(f"--mem_budget_gb must be a finite number > 0 (got {args.mem_budget_gb})")
    for name in ("max_micro_batch", "probe_steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1 (got {getattr(args, name)})")


def _max_batch_dir(spec, args):
    """Each budget's search in a directory of its own: another budget is another search."""
    budget = f"budget_{args.mem_budget_gb:g}GiB" if args.mem_budget_gb else "budget_device"
    return spec.directory / "max_batch" / budget


def _max_batch(args, spec, runs, probe_runner) -> int:
    configs = {}
    for run in runs:  # one search per configuration: the micro_batch dimension is searched instead
        configs.setdefault(run.config_key, run)
    results, failures = [], 0
    with runs_bar(len(configs), f"{spec.name} max batch") as bar:
        for stem, base in configs.items():
            try:
                result = search(base, probe_runner, args.mem_budget_gb, args.probe_steps, spec.steps,
                                args.max_micro_batch, report=lambda o: bar.write(f"    {o.line()}"))
            except SearchError as e:
                failures += 1
                bar.write(f"{stem}: no answer: {e}")
            else:
                results.append(result)
                rate = f"{result.samples_per_s:.1f} samples/s" if result.samples_per_s else "n/a"
                bar.write(f"{stem}: largest micro-batch {result.best_micro_batch} | {rate}")
            bar.update()
    out = probe_runner.directory / "max_batch.json"
    write_results(out, results)
    print(f"{len(results)} searches, {failures} without an answer; results in {out}")
    return 1 if failures else 0

