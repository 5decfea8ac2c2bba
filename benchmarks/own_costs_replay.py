#!/usr/bin/env python
"""The zoo's predictions replayed with each configuration's own costs refitted by the code as it is now.

    python benchmarks/own_costs_replay.py runs/reference/cpu-2core-zoo-world2 runs/reference/cpu-2core-zoo-deepspeed-world1

Each records folder of benchmarks/zoo_accuracy.py keeps the probe runs its plans' own costs were fitted
from (RUNS_DIR/backend_costs.json: each point's repeats, measured and predicted). This refits them
with analysis/plan/backend_costs.py as it is now (point_seconds, fit) and re-prices every fitting
candidate of every model's plan.json: its step as the plan priced it, less the own cost it was charged,
plus the refitted one, priced at the machine's speed the plan read (backend_costs.at_speed).
`--three_points` refits from the three probe points of before the wide one; `--unscaled` prices
them as measured; `--repeats fastest` takes each probe point's step as the fastest of its three runs
(the rule until 2026-12-02), not their median (backend_costs.point_seconds, POINT_RULE). Nothing runs; the predictions' other parts (compute, communication) stay as
the plan made them. Prints, per model, the median |predicted / measured - 1| over the fitting
candidates (measured: the grid's median) and Spearman's rank correlation, as recorded and replayed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from analysis import compact  # noqa: E402 (a records folder read as it is: a folder, or in its compact form)
from analysis.plan.backend_costs import (POINT_RULE, at_speed, cost_seconds, fit_runs, items, key,  # noqa: E402
                                         trainable_params)
from benchmarks.zoo import ZOO  # noqa: E402
from benchmarks.zoo_figures import model_accuracy, question_of, spearman  # noqa: E402
from simulation.describe import resolve_flags  # noqa: E402


def speed_now(saved: dict) -> float | None:
    """The machine's reference step the plan read (its assumptions line, backend_costs.summary_line), in
    seconds: the refitted costs are priced at it as the plan priced its own (backend_costs.at_speed);
    None where the plan scaled nothing."""
    for line in saved.get("assumptions", []):
        found = re.search(r"the reference step ([0-9.]+) ms now", line)
        if found:
            return float(found.group(1)) / 1e3
    return None


def replay(model_dir: Path, costs: dict, three_points: bool = False, unscaled: bool = False,
           repeats: str | None = None) -> dict:
    """One model's plan.json re-priced with `costs` refitted (backend_costs.fit_runs, the code now; with
    `three_points`, from the three points of before the wide one: no cost per parameter), at the speed
    the plan read (with `unscaled`, as measured), each point's step by the rule `repeats` (None:
    backend_costs.POINT_RULE; "median" or "fastest" of its runs, point_seconds): {recorded, replayed}: (median error, Spearman) over the fitting candidates the grid
    measured."""
    world = question_of(model_dir).world
    acc = model_accuracy(model_dir, estimate=lambda record: 1)  # the peaks are not asked
    measured = acc["grid_median"]
    saved = compact.read_json(model_dir / "plan.json")
    now = None if unscaled else speed_now(saved)
    n_items: dict[str, tuple[int, int]] = {}
    replayed = []
    for c in saved["candidates"]:
        flags = " ".join(c.get("config_flags", []))
        if not c.get("fits") or flags not in measured:
            continue
        step = c["step_ms"] / 1e3
        entry = costs.get(key(c.get("base") or c["config"], world))
        new = step
        if entry is not None and "runs" in entry:
            if c["backend"] not in n_items:
                setup = resolve_flags([*ZOO[model_dir.name].flags, *c["config_flags"]], world)
                n_items[c["backend"]] = (items(setup, c["backend"])[1], trainable_params(setup))
            accum = int(c["micro x accum"].split("x")[1])
            fitted = fit_runs(entry["runs"], entry["items"], None if three_points else entry.get("params"),
                              repeats or POINT_RULE)
            fitted = at_speed({**fitted, "reference_s": entry.get("reference_s")}, now)
            new = step - c["own_ms"] / 1e3 + cost_seconds(fitted, accum, *n_items[c["backend"]])
        replayed.append((c["pred_samples_per_s"] * step / new, measured[flags]))
    return {"recorded": (acc["median_before"], acc["spearman"]),
            "replayed": (statistics.median(abs(p / m - 1) for p, m in replayed),
                         spearman([p for p, _ in replayed], [m for _, m in replayed]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("runs_dirs", nargs="+", type=Path, help="records folders of benchmarks/zoo_accuracy.py")
    p.add_argument("--three_points", action="store_true",
                   help="refit from the three probe points alone (no cost per trainable parameter): what the "
                        "wide point changed, on the same runs")
    p.add_argument("--unscaled", action="store_true",
                   help="price the refitted costs as measured, not at the speed the plan read (at_speed)")
    p.add_argument("--repeats", choices=("median", "fastest"), default=None,
                   help="a probe point's step from its three runs: their median (backend_costs.POINT_RULE, "
                        "the default) or the fastest (the rule until 2026-12-02)")
    args = p.parse_args()
    for runs_dir in args.runs_dirs:
        kept = runs_dir / "backend_costs.json"
        if not compact.is_file(kept):
            print(f"{runs_dir}: no backend_costs.json, nothing to refit")
            continue
        costs = compact.read_json(kept)
        for d in compact.iterdir(runs_dir):
            if compact.is_file(d / "plan.json") and compact.is_file(d / "grid.json"):
                r = replay(d, costs, args.three_points, args.unscaled, args.repeats)
                print(f"{runs_dir.name} {d.name}: recorded {r['recorded'][0]:.0%} ({r['recorded'][1]:.2f}), "
                      f"replayed {r['replayed'][0]:.0%} ({r['replayed'][1]:.2f})", flush=True)


if __name__ == "__main__":
    main()
