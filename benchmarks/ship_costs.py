#!/usr/bin/env python
"""Ship the configurations' own costs measured on one machine kind with the suite: a plan on a machine
of that kind with nothing kept prices with them (analysis/plan/backend_costs.py shipped(), the plan
saying so) instead of measuring first.

    GPTLITE_BACKEND_COSTS=/tmp/costs.json python -m analysis.plan --world 2 --gpu here --mem_budget_gb 1 \
        --global_batch 16 --backend_costs measure --model analysis/plan/probe_model.py   # on an idle machine
    python benchmarks/ship_costs.py /tmp/costs.json --measured "2026-12-04 18:46-18:55 UTC, ..."

Run on the machine that measured them. Reads a kept costs file (backend_costs.json: each
configuration's entry with its probe runs, and the link they were fitted against) and writes its
entries into analysis/plan/shipped_costs.json as one kind (its machine key's CPU, cores and
calibration: backend_costs.KIND, and this machine's device type), replacing what was shipped for that kind. Every entry must have been measured on that one machine, in full (REPEATS runs a
point), with its runs (a plan refits them by the code as it is), and the link beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from analysis.plan.backend_costs import KIND, REPEATS, SHIPPED, probe_device, runs_per_point  # noqa: E402


def kind_entries(kept: dict) -> dict:
    """The entries of a kept costs file to ship, checked: one machine, full runs, the link beside them."""
    machines = {json.dumps({f: e["machine"].get(f) for f in KIND}, sort_keys=True) for e in kept.values()}
    if len(machines) != 1:
        sys.exit(f"the entries were measured on {len(machines)} machine kinds; ship one kind at a time")
    for k, e in kept.items():
        if k.startswith("link|"):
            continue
        if "runs" not in e or runs_per_point(e) < REPEATS:
            sys.exit(f"{k}: not measured in full ({REPEATS} runs a probe point, kept): --backend_costs measure")
    worlds = {k.split("|")[1] for k in kept}
    missing = [w for w in worlds if f"link|{w}" not in kept]
    if missing:
        sys.exit(f"no link kept for {', '.join(missing)}: the costs are fitted against one")
    return kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("kept", type=Path, help="a kept costs file (backend_costs.json)")
    p.add_argument("--measured", required=True, help="when and how they were measured (the plan prints it)")
    p.add_argument("--out", type=Path, default=SHIPPED)
    args = p.parse_args()
    entries = kind_entries(json.loads(args.kept.read_text()))
    kind = {f: next(iter(entries.values()))["machine"].get(f) for f in KIND}
    shipped = json.loads(args.out.read_text()) if args.out.is_file() else {"kinds": []}
    others = [k for k in shipped["kinds"]
              if {f: next(iter(k["entries"].values()))["machine"].get(f) for f in KIND} != kind]
    # the probes ran on this machine's device (the kept file was measured here: the same machine key)
    shipped["kinds"] = [*others, {"measured": args.measured, "device": probe_device(), "entries": entries}]
    args.out.write_text(json.dumps(shipped, indent=1) + "\n")
    print(f"{args.out}: {len(entries)} entries for {kind['cpu']}, {kind['cores']} cores "
          f"({len(shipped['kinds'])} kinds)")


if __name__ == "__main__":
    main()
