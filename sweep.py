#!/usr/bin/env python
"""Run a matrix of training runs from a YAML spec, one at a time, through the real launchers.

    python sweep.py sweeps/cpu_quick.yaml              # every run of the matrix
    python sweep.py sweeps/cpu_quick.yaml --dry_run    # list the runs and their commands
    python sweep.py sweeps/cpu_quick.yaml --max_batch --mem_budget_gb 2   # largest micro-batch per config
    python -m analysis.report runs/sweeps/cpu_quick --out reports/cpu_quick
"""

from __future__ import annotations

import argparse
import collections
import sys
import textwrap

from gptlite.errors import ConfigError

EPILOG = textwrap.dedent("""\
    A spec (see sweeps/README.md) is a matrix over backend configs (single, ddp, fsdp_configs/*.yaml,
    ds_configs/*.json), ckpt_interval, ckpt_impl, micro_batch, precision, world_size and preset,
    plus train.py flags shared by every run (train_args). Records go to runs/sweeps/<name>/ (or the
    spec's runs_dir); each run's launcher output to <that>/.logs/<run>.log. A failed, out-of-memory
    or timed-out run is recorded with that status and the sweep goes on; running the spec again
    skips runs already done (--retry_failed reruns failed and timed-out ones).""")


def build_parser() -> argparse.ArgumentParser:
    from training.cli import OneLineParser

    p = OneLineParser(prog="sweep.py", description=__doc__.splitlines()[0], epilog=EPILOG,
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
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from training.sweep import Runner, expand, load_spec

    try:
        spec = load_spec(args.spec)
        runs, skipped = expand(spec)
        if args.max_batch:
            _check_budget(args)
    except ConfigError as e:
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    runner = Runner(spec.directory, spec.timeout_s, retry_failed=args.retry_failed)
    if args.dry_run:
        for run in runs:
            print(f"{run.name}\n    {' '.join(run.command(spec.directory))}")
        for reason in skipped:
            print(f"left out: {reason}")
        print(f"{len(runs)} runs into {spec.directory}")
        return 0
    if args.max_batch:
        return _max_batch(args, spec, runs, runner)
    return _sweep(spec, runs, runner)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=not sys.stderr.isatty(), dynamic_ncols=True)


def _sweep(spec, runs, runner) -> int:
    counts = collections.Counter()
    with _progress(len(runs), spec.name) as bar:
        for i, run in enumerate(runs, 1):
            bar.set_postfix_str(run.name, refresh=True)
            outcome = runner.run(run)
            counts[outcome.status] += 1
            bar.write(f"[{i}/{len(runs)}] {outcome.line()}")
            bar.update()
    done = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"{spec.name}: {done}; records in {spec.directory}")
    return 0


def _check_budget(args) -> None:
    import torch

    if args.mem_budget_gb is None and not torch.cuda.is_available():
        raise ConfigError("--max_batch on CPU needs --mem_budget_gb (the CPU has no device memory limit)")


def _max_batch(args, spec, runs, runner) -> int:
    from training.max_batch import SearchError, search, write_results
    from training.sweep import Runner

    configs = {}
    for run in runs:  # one search per configuration: the micro_batch dimension is searched instead
        configs.setdefault(run.config_key, run)
    probe_runner = Runner(spec.directory / "max_batch", spec.timeout_s, retry_failed=args.retry_failed)
    results, failures = [], 0
    with _progress(len(configs), f"{spec.name} max batch") as bar:
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
    out = spec.directory / "max_batch" / "max_batch.json"
    write_results(out, results)
    print(f"{len(results)} searches, {failures} without an answer; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
