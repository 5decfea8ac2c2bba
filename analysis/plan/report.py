"""What a plan prints and writes: the ranked table, the verified runs against their predictions, the
race, --json's object, and --out's plan.md and plan.png."""

from __future__ import annotations

import builtins
import functools
import io
import json
import math
import shlex
import sys
from pathlib import Path

import pandas as pd

from analysis.tables import within_spread
from analysis.plan.candidates import MARGIN
from analysis.plan.device import Device


def _race_summary(raced: dict) -> dict:
    """What --json says of a race: its rounds (each run's candidate, steps, samples/s, status), the
    steps and seconds it ran against the grid's, and its --race_within."""
    keys = ("candidate", "command", "steps", "status", "measured_samples_per_s", "race_samples_per_s",
            "measured_peak_gb", "record", "run_seconds")
    return {"rounds": [[{k: m.get(k) for k in keys} for m in rnd] for rnd in raced["rounds"]],
            **{k: raced[k] for k in ("runs", "grid_runs", "steps_run", "grid_steps", "run_seconds", "within", "tied")}}


def print_verified(verified: list[dict], fitted: dict | None, fitting: list[dict], pick: str | None,
                    ties: list[str], raced: dict | None = None, file=None) -> None:
    print = functools.partial(builtins.print, file=file or sys.stdout)
    print("\npredicted against measured (peaks in GiB; each candidate's command below the table):")
    table = pd.DataFrame(verified).drop(columns=["record", "records", "measured_spread", "command", "run_seconds"], errors="ignore")
    table.insert(0, "#", range(1, len(verified) + 1))
    if "measured_runs" in table:  # each run's samples/s, in the order they ran
        table["measured_runs"] = ["/".join("-" if x is None else f"{x:.3g}" for x in runs)
                                  for runs in table["measured_runs"]]
    # The spread over the median: one run's timed steps' interquartile range, or its runs' range.
    table.insert(table.columns.get_loc("measured_samples_per_s") + 1, "spread",
                 [(v["measured_spread"][1] - v["measured_spread"][0]) / v["measured_samples_per_s"]
                  if v["measured_samples_per_s"] and None not in v["measured_spread"] else None for v in verified])
    print(table.to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
    for i, v in enumerate(verified, 1):  # a command is 100-200 characters: never a column
        print(f"  {i}: {v['command']}")
    if fitted:
        overhead = ", ".join(f"{c} x {o:.3g}" for c, o in fitted["overhead"].items())
        steps = (f" (its micro-steps' fixed cost x {fitted['micro_step_factor']:.3g})"
                 if "micro_step_factor" in fitted else "")
        print(f"\nrefitted on {fitted['runs']} verified candidates: compute x {fitted['compute_factor']:.3g}{steps}, overlap "
              f"{fitted['overlap']:.2f}; each verified configuration's overhead: {overhead}; re-ranked, "
              f"the top {min(5, len(fitting))}:")
        again = sorted(fitting, key=lambda r: -r["refit_samples_per_s"])[:5]
        print(pd.DataFrame(again)[["config", "micro x accum", "ckpt", "est_peak_gb", "pred_samples_per_s",
                                   "refit_samples_per_s"]].to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
    if raced is not None:
        print(f"\nthe race: {raced['runs']} runs in {len(raced['rounds'])} rounds, "
              + ", ".join(f"{len(r)} x {r[0]['steps']} steps" for r in raced["rounds"])
              + f": {raced['steps_run']} steps against the grid's {raced['grid_steps']} "
              f"(its {raced['grid_runs']} fitting candidates once: "
              f"{raced['steps_run'] / max(raced['grid_steps'], 1):.0%}), {raced['run_seconds']:.0f} s of runs")
        print("\npick (the race's winner):", pick or "none of the raced runs")
        if raced.get("tied"):
            print("  the last two's runs did not resolve them (their gap within their own runs' spread): "
                  "the one predicted faster")
    else:
        print("\npick (fastest measured within the budget):", pick or "none of the verified runs")
    for command in ties:
        print(f"  a tie, not a win: {command} (its spread overlaps the pick's)")


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, samples/s) points no other point beats on both: less memory and more samples/s,
    by increasing memory."""
    best, out = -math.inf, []
    for mem, rate in sorted(points, key=lambda p: (p[0], -p[1])):
        if rate > best:
            out.append((mem, rate))
            best = rate
    return out


def write_out(out: Path, rows: list[dict], device: Device, args, verified: list[dict],
              fitted: dict | None, pick: str | None, ties: list[str], argv: list[str], raced: dict | None = None) -> None:
    """--out DIR: plan.md (the ranked table, what was verified, the pick) and plan.png (every
    candidate's estimated peak against its predicted samples/s, the frontier, the budget, and the
    verified runs as measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fitting = [r for r in rows if r.get("fits")]
    out.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    print_table(rows, device, args, file=text)
    if (args.verify or args.race) and fitting:
        print_verified(verified, fitted, fitting, pick, ties, raced, file=text)
    shown = [r for r in rows if "pred_samples_per_s" in r]
    # After --verify's refit, every candidate where the refitted model puts it.
    speed, said = ("refit_samples_per_s", "refitted") if fitted else ("pred_samples_per_s", "predicted")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    if shown:
        frame = {"estimated peak per rank (GiB)": [r["est_peak_gb"] for r in shown],
                 f"{said} samples/s": [r[speed] for r in shown],
                 "config": [r["config"] for r in shown],
                 "fits": ["fits" if r.get("fits") else "over the budget" for r in shown]}
        sns.scatterplot(frame, x="estimated peak per rank (GiB)", y=f"{said} samples/s", hue="config", style="fits",
                        style_order=["fits", "over the budget"], ax=ax, s=40)
        edge = frontier([(r["est_peak_gb"], r[speed]) for r in shown])
        ax.plot(*zip(*edge), color="grey", drawstyle="steps-post", linewidth=1, label=f"frontier ({said})")
    ax.axvline(args.mem_budget_gb, color="red", linestyle="--", linewidth=1, label=f"budget {args.mem_budget_gb:g} GiB")
    ax.axvline(args.mem_budget_gb * (1 - MARGIN), color="red", linestyle=":", linewidth=1,
               label=f"budget less the estimator's band ({MARGIN:.0%})")
    measured = [v for v in verified if v.get("measured_samples_per_s") and v.get("measured_peak_gb") is not None]
    if measured:
        ax.scatter([v["measured_peak_gb"] for v in measured], [v["measured_samples_per_s"] for v in measured],
                   marker="x", color="black", s=60, label="verified: measured")
    chosen = next((v for v in measured if v["command"] == pick), None) or \
        next((r for r in shown if r.get("command") == pick and not verified), None)
    if chosen:
        x = chosen.get("measured_peak_gb", chosen.get("est_peak_gb"))
        y = chosen.get("measured_samples_per_s", chosen.get(speed))
        ax.scatter([x], [y], marker="*", color="gold", edgecolor="black", s=250, zorder=5, label="pick")
    ax.set(title=f"{len(rows)} candidates, world {args.world}, global batch {args.global_batch}, on {device.name}",
           xlabel="peak per rank, GiB (estimated; verified runs: measured)",
           ylabel=f"samples/s ({said}; verified runs: measured)")
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(out / "plan.png", dpi=110)
    plt.close(fig)
    (out / "plan.md").write_text(
        f"# Plan: world {args.world}, budget {args.mem_budget_gb:g} GiB per rank, global batch {args.global_batch}\n\n"
        f"`python -m analysis.plan {shlex.join(argv)}`\n\n"
        f"```\n{text.getvalue().strip()}\n```\n\n"
        + (f"Pick:\n\n```\n{pick}\n```\n\n" if pick else "No pick: no candidate fits.\n\n")
        + f"![estimated peak against {said} samples/s](plan.png)\n")


def _ties(best: dict | None, within: list[dict]) -> list[str]:
    """The commands of the verified runs within the budget whose measured spread (one run's timed
    steps' quartiles of samples/s, or its runs' range: _measured) overlaps the pick's: as fast as the
    pick within the noise of the measurement."""
    if best is None:
        return []
    return [v["command"] for v in within if v is not best
            and within_spread(tuple(v.get("measured_spread") or (None, None)),
                              tuple(best.get("measured_spread") or (None, None)))]


def print_table(rows: list[dict], device: Device, args, file=None) -> int:
    """The ranked table of the fitting candidates and the pick, or why none fits (exit code 1)."""
    fitting = [r for r in rows if r.get("fits")]
    print = functools.partial(builtins.print, file=file or sys.stdout)
    print(f"{len(rows)} candidates on {device.name}, world {args.world}, budget {args.mem_budget_gb:g} GiB per rank, "
          f"global batch {args.global_batch}: {len(fitting)} fit, "
          f"{sum('breaks' in r for r in rows)} over the budget, {sum('refused' in r for r in rows)} refused by train.py")
    for note in device.notes:
        print(f"  {note}")
    if fitting:
        columns = ["config", "micro x accum", "ckpt", "est_peak_gb", "margin_gb", "compute_ms", "comm_ms", "wait_ms",
                   "offload_ms", "own_ms", "step_ms", "pred_samples_per_s"]
        table = pd.DataFrame(fitting[:args.top])[columns]
        print(table.to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
        print("\npredicted pick:" if args.verify or args.race else "\npick:", fitting[0]["command"])
    else:
        least = min((r for r in rows if "est_peak_gb" in r), key=lambda r: r["est_peak_gb"], default=None)
        print("no candidate fits" + (f": the smallest estimated peak is {least['est_peak_gb']:.3g} GiB "
                                     f"({least['command']}; {least['breaks']})" if least else ""))
        return 1
    return 0


def outcome(rows: list[dict], verified: list[dict], raced: dict | None, args) -> tuple[str | None, list[str]]:
    """(the pick's command, the commands tied with it): the fastest measured within the budget, the race's
    winner, or (nothing run) the best predicted; None where nothing fits or nothing measured did."""
    fitting = [r for r in rows if r.get("fits")]
    within = [v for v in verified if v["status"] == "ok" and v["measured_peak_gb"] is not None
              and v["measured_peak_gb"] <= args.mem_budget_gb]
    best = max(within, key=lambda v: v["measured_samples_per_s"] or 0.0, default=None)
    if raced is not None:  # the race's winner: its last round's fastest (an earlier round's shorter runs lost to it)
        best = raced["pick"] and raced["latest"][raced["pick"]["command"]]
        within = [v for v in within if v.get("round") == (best or {}).get("round")]
    pick = best["command"] if best else (fitting[0]["command"] if fitting and not (args.verify or args.race) else None)
    return pick, _ties(best, within)


def print_json(rows: list[dict], device: Device, args, verified: list[dict], fitted: dict | None, pick: str | None,
               ties: list[str], raced: dict | None) -> None:
    """--json: one object, the candidates ranked (each with its configuration's flags) and the pick, the
    calibration replay() re-prices it from, and with --verify or --race what ran."""
    shown = [{**{k: v for k, v in r.items() if k != "candidate"}, "config_flags": r["candidate"].flags()}
             for r in rows]
    calibration = ({"calibration": {"micro_step_s": device.micro_step_s, "sample_s": device.sample_s,
                                    "optimizer_s": device.optimizer_s, "recompute": device.recompute}}
                   if device.flops_per_s is None else {})  # what replay() needs to re-price the plan
    print(json.dumps({"device": device.name, "assumptions": device.notes, **calibration, "candidates": shown,
                      "pick": pick,
                      **({"verified": verified, "refit": fitted, "ties_with_pick": ties}
                         if args.verify or args.race else {}),
                      **({"race": _race_summary(raced)} if raced is not None else {})},
                     indent=2))
