"""Do two folders of run records hold the same runs? Same run names, same statuses, the same loss at
every step (to a tolerance): what a change that should not change training must leave as it was.

    python -m analysis.same_runs runs/sweeps/cpu_quick /tmp/before/runs/sweeps/cpu_quick

Prints one line per run and a verdict; exit 0 when the folders agree, 1 when they differ, 2 on bad input.
Speed, memory and times are not compared: they move from run to run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def read_runs(folder: Path) -> dict[str, dict]:
    """{run name: {"status": ..., "losses": [loss at each step]}} for every run folder under `folder`."""
    runs = {}
    for summary_path in sorted(folder.rglob("summary.json")):
        run = summary_path.parent
        summary = json.loads(summary_path.read_text())
        losses = []
        metrics = run / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if "loss" in row and "step" in row:
                        losses.append((row["step"], row["loss"]))
        runs[str(run.relative_to(folder))] = {"status": summary.get("status"), "losses": losses}
    return runs


def compare(before: dict[str, dict], after: dict[str, dict], rtol: float) -> list[str]:
    """The differences, one line each (empty when the two agree)."""
    problems = [f"{name}: only in the first folder" for name in sorted(before.keys() - after.keys())]
    problems += [f"{name}: only in the second folder" for name in sorted(after.keys() - before.keys())]
    for name in sorted(before.keys() & after.keys()):
        a, b = before[name], after[name]
        if a["status"] != b["status"]:
            problems.append(f"{name}: status {a['status']} -> {b['status']}")
        if [s for s, _ in a["losses"]] != [s for s, _ in b["losses"]]:
            problems.append(f"{name}: steps differ ({len(a['losses'])} -> {len(b['losses'])} logged)")
            continue
        for (step, la), (_, lb) in zip(a["losses"], b["losses"]):
            if not math.isclose(la, lb, rel_tol=rtol, abs_tol=0.0):
                problems.append(f"{name}: step {step} loss {la!r} -> {lb!r}")
                break
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.same_runs", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path, help="a folder of run records (e.g. runs/sweeps/cpu_quick)")
    parser.add_argument("second", type=Path, help="the folder to compare it with")
    parser.add_argument("--rtol", type=float, default=1e-6,
                        help="relative tolerance on each step's loss (default 1e-6)")
    args = parser.parse_args(argv)
    for folder in (args.first, args.second):
        if not folder.is_dir():
            print(f"{folder}: not a folder of run records", file=sys.stderr)
            return 2
    before, after = read_runs(args.first), read_runs(args.second)
    if not before:
        print(f"{args.first}: no run records (summary.json) under it", file=sys.stderr)
        return 2
    problems = compare(before, after, args.rtol)
    for name in sorted(before.keys() & after.keys()):
        steps = len(before[name]["losses"])
        print(f"{name}: {before[name]['status']} -> {after[name]['status']}, {steps} step losses")
    for line in problems:
        print(f"DIFFERS {line}")
    print(f"{len(before)} runs in the first, {len(after)} in the second: "
          + ("the same runs, statuses and losses" if not problems else f"{len(problems)} differences"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
