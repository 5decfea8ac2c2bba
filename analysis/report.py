"""Write a comparison report of the runs under a directory: report.md and its figures.

    python -m analysis.report runs/sweeps/cpu_quick --out reports/cpu_quick
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pandas as pd

from analysis import compact, figures, tables
from estimator.estimate import estimate_from_record
from analysis.runs import load_metrics, load_runs, require_records, run_config
from gptlite.errors import ConfigError
from training.cli import OneLineParser
from training.preflight import writable_out

FIGURES = {
    "throughput_memory.png": "Throughput, and average and peak memory per rank, per backend configuration",
    "memory_vs_batch.png": "Peak memory against micro-batch, with and without checkpointing",
    "throughput_vs_batch.png": "Throughput against micro-batch",
    "pareto.png": "Peak memory against throughput, and the Pareto frontier",
    "ckpt_frontier.png": "Checkpointing policies per model and backend: peak memory against throughput, and each "
                         "panel's Pareto frontier",
    "loss_curves.png": "Loss per step of every run: equal curves, equal training",
}


def with_estimates(runs: pd.DataFrame) -> pd.DataFrame:
    """`runs` with the memory estimator's numbers for each successful run (estimate.* columns)."""
    rows = []
    for _, run in runs.iterrows():
        try:
            est = estimate_from_record(run_config(run)) if run.get("status") == "ok" else None
        except Exception as e:  # noqa: BLE001 - no config.json, another schema, a model that cannot be traced here
            print(f"no estimate for {run.get('run_name')}: {e}", file=sys.stderr)
            est = None
        rows.append({} if est is None else {
            "estimate.model_states_bytes": est.model_states_bytes,
            "estimate.activation_bytes": est.activation_bytes,
            "estimate.total_bytes": est.total_bytes,
        })
    return pd.concat([runs.reset_index(drop=True), pd.DataFrame(rows)], axis=1)


def memory_limit(runs_dir: Path, runs: pd.DataFrame) -> float | None:
    """The budget of a largest-batch search, else the CUDA device's memory, else None."""
    budgets = [r["budget_gb"] for r in tables.max_batch_results(runs_dir) if r.get("budget_gb")]
    return max(budgets) * 2**30 if budgets else None


def write_report(runs_dir: str | Path, out: str | Path) -> Path:
    runs_dir, out = Path(runs_dir), Path(out)
    runs = with_estimates(require_records(load_runs(runs_dir), runs_dir))  # before anything is written
    metrics = load_metrics(runs_dir)
    out.mkdir(parents=True, exist_ok=True)
    # With several models, the figures name each configuration with its model.
    drawn = runs.assign(label=runs["model"] + " " + runs["label"]) \
        if runs["model"].nunique() > 1 else runs
    draw = {
        "throughput_memory.png": lambda: figures.throughput_and_memory(drawn),
        "memory_vs_batch.png": lambda: figures.memory_vs_batch(drawn, memory_limit(runs_dir, runs)),
        "throughput_vs_batch.png": lambda: figures.throughput_vs_batch(drawn),
        "pareto.png": lambda: figures.pareto(drawn),
        "ckpt_frontier.png": lambda: figures.ckpt_frontier(runs),
        "loss_curves.png": lambda: figures.loss_curves(metrics, drawn),
    }
    for name, make in draw.items():
        fig = make()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)

    counts = runs["status"].value_counts().to_dict()
    devices = ", ".join(sorted(set(runs["device_name"].dropna())))
    lines = [
        f"# Backend comparison: {runs_dir.name}",
        "",
        f"{len(runs)} runs from `{runs_dir}` ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}), "
        f"on {devices or 'unknown device'}. Written {time.strftime('%Y-%m-%d %H:%M')} by `python -m analysis.report`.",
        "",
        "Throughput: median over timed steps of global batch / step time (the slowest rank's); spread: the "
        "timed steps' interquartile range over that median. Against DDP, a run whose interquartile range overlaps "
        "DDP's is a tie, not a win or a loss: one run each cannot tell them apart. Memory: per rank, "
        "the maximum over ranks; on CUDA the allocator's peak, on CPU the peak of live tensor bytes in the "
        "profiled step (runs/README.md). The estimate is `python -m analysis.estimate_cli` for the same configuration.",
        "",
        "## Runs",
        "",
        tables.markdown(tables.main_table(runs)),
        "## Against DDP (same model, preset, global batch, precision and ranks)",
        "",
        tables.markdown(tables.ddp_ratios(runs)),
    ]
    communication = tables.comm_table(runs)
    if not communication.empty:
        lines += ["## Communication per step (rank 0, profiled step; core/comm.py)", "",
                  tables.markdown(communication)]
    budgets = tables.budget_table(runs)
    if not budgets.empty:
        lines += ["## Checkpointing by memory budget (--ckpt_policy auto)", "",
                  "Each budget run beside the fastest run of a hand-set policy (no plan) of the same configuration "
                  "whose measured peak fits the same budget. Peak / budget above 1 is a run over its budget "
                  "(recorded oom on CPU).", "", tables.markdown(budgets)]
    largest = tables.max_batch_table(runs_dir)
    if not largest.empty:
        lines += ["## Largest micro-batch", "", tables.markdown(largest)]
    tracked = tables.tracker_table(runs)
    if not tracked.empty:
        lines += ["## Trackers", "", f"Runs also logged with --tracker (docs/trackers.md). `tensorboard --logdir {runs_dir}` "
                  "lays every run's curves over the others, each named as its record.", "", tables.markdown(tracked)]
    lines += ["## Runs that did not succeed", "", tables.markdown(tables.failures(runs)), "## Figures", ""]
    for name, caption in FIGURES.items():
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m analysis.report", description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir", help="directory of run records (searched recursively)")
    parser.add_argument("--out", required=True, help="directory for report.md and the figures")
    args = parser.parse_args(argv)
    try:
        writable_out("--out", args.out)
    except ConfigError as e:
        parser.error(str(e))
    if not compact.is_dir(args.runs_dir):  # a folder, or one inside a compact folder (analysis/compact.py)
        parser.error(f"runs_dir {args.runs_dir} is not a directory")
    matplotlib.use("Agg")  # the report only writes files (a notebook importing this module keeps its backend)
    try:
        print(write_report(args.runs_dir, args.out))
    except ConfigError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
