"""Print a comparison table of the runs under a directory.

    python -m analysis.table runs/demo
"""

from __future__ import annotations

import sys

from analysis.runs import load_runs, require_records

COLUMNS = {
    "run_name": "run",
    "status": "status",
    "backend": "backend",
    "model": "model",
    "world_size": "ranks",
    "global_batch": "batch",
    "precision": "precision",
    "samples_per_s": "samples/s",
    "mem_peak_bytes": "peak MiB",
    "model_state_bytes.total": "model states MiB",
    "final_loss": "final loss",
    "val_loss": "val loss",
}


def comparison_table(runs_dir: str):
    """The comparison table of the records under `runs_dir`; ConfigError where there are none."""
    runs = require_records(load_runs(runs_dir), runs_dir)
    table = runs.reindex(columns=list(COLUMNS)).rename(columns=COLUMNS)
    for col in ("peak MiB", "model states MiB"):
        table[col] = table[col] / 2**20
    return table


def main(argv=None) -> int:
    from training.cli import OneLineParser

    parser = OneLineParser(prog="python -m analysis.table", description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir", help="directory of run records (searched recursively)")
    args = parser.parse_args(argv)
    from gptlite.errors import ConfigError

    try:
        table = comparison_table(args.runs_dir)
    except ConfigError as e:
        parser.error(str(e))
    print(table.to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
