"""Tables from run records: the main comparison, ratios to DDP, failures, largest batches; run as a
module, it prints the comparison table of the runs under a directory.

    python -m analysis.tables runs/demo
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.runs import load_runs, require_records
from backends import DDP
from gptlite.errors import ConfigError
from training.cli import OneLineParser

MIB = 2**20
# The configuration a run is compared with: same model, batch, precision and ranks.
GROUP = ["model", "preset", "global_batch", "precision", "world_size"]


def with_model_column(table: pd.DataFrame, runs: pd.DataFrame, sort: list[str]) -> pd.DataFrame:
    """`table` with a `model` column first and sorted by it, where the runs compared several models."""
    if "model" in runs and runs["model"].nunique() > 1:
        table.insert(0, "model", runs["model"].values)
        sort = ["model", *sort]
    return table.sort_values(sort).reset_index(drop=True)


def within_spread(a: tuple, b: tuple) -> bool | None:
    """Whether two runs' spreads of samples/s, (first quartile, third quartile) over their timed
    steps, overlap: a difference inside the noise of either, a tie rather than a win. None when
    either run has no spread (records from before it was recorded)."""
    values = [*a, *b]
    if any(v is None or (isinstance(v, float) and np.isnan(v)) for v in values):
        return None
    return max(a[0], b[0]) <= min(a[1], b[1])


def _column(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series(np.nan, index=frame.index)


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["status"] == "ok"].copy() if not runs.empty else runs


def main_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One line per successful run: throughput, memory and loss, with the estimate beside it."""
    ok = ok_runs(runs)
    if ok.empty:
        return pd.DataFrame()
    table = pd.DataFrame({
        "config": ok["label"],
        "ckpt": ok["ckpt"],
        "ranks": ok["world_size"],
        "micro": ok["micro_batch"],
        "batch": ok["global_batch"],
        "samples/s": ok.get("samples_per_s"),
        # The timed steps' interquartile range over their median: how far one step's rate strays.
        "spread": (_column(ok, "samples_per_s_p75") - _column(ok, "samples_per_s_p25")) / ok.get("samples_per_s"),
        "peak MiB": ok.get("mem_peak_bytes") / MIB,
        "avg MiB": ok.get("mem_avg_bytes") / MIB,
        "activation MiB": _column(ok, "mem_breakdown.activation") / MIB,
        "model states MiB": ok.get("model_state_bytes.total") / MIB,
    })
    if "estimate.total_bytes" in ok:
        table["estimate MiB"] = ok["estimate.total_bytes"] / MIB
        table["estimate error"] = ok["estimate.total_bytes"] / ok["mem_peak_bytes"] - 1
        table["model states est. error"] = ok["estimate.model_states_bytes"] / ok["model_state_bytes.total"] - 1
    table["final loss"] = ok.get("final_loss")
    if "compile" in ok and (ok["compile"] != "none").any():  # only where a sweep compared it
        table.insert(2, "compile", ok["compile"])
        table["compile s"] = ok.get("compile.compile_s")
        table["graph breaks"] = ok.get("compile.graph_breaks")
    return with_model_column(table, ok, ["batch", "config", "ckpt"])


def ddp_ratios(runs: pd.DataFrame) -> pd.DataFrame:
    """Each run's samples/s and peak memory as ratios to DDP's with the same model, preset, global batch,
    precision and world size (DDP without checkpointing where there is one)."""
    ok = ok_runs(runs)
    if ok.empty or DDP not in set(ok["label"]):  # the baseline: DDP's label is its name
        return pd.DataFrame()
    # Records from before the quartiles were kept have none: their ties are unknown, not false.
    ok = ok.assign(samples_per_s_p25=_column(ok, "samples_per_s_p25"), samples_per_s_p75=_column(ok, "samples_per_s_p75"))
    ddp = ok[ok["label"] == DDP].assign(_compiled=lambda d: d.get("compile", "none") != "none",
                                          _checkpointed=lambda d: d["ckpt"] != "none")
    # Eager and without checkpointing first (a plan's run records ckpt_interval 0 too: its label says it).
    ddp = ddp.sort_values(["_compiled", "_checkpointed", "ckpt_interval"]).drop_duplicates(GROUP)
    base = ddp.set_index(GROUP)[["samples_per_s", "mem_peak_bytes", "samples_per_s_p25", "samples_per_s_p75"]]
    joined = ok.merge(base, left_on=GROUP, right_index=True, how="left", suffixes=("", "_ddp"))
    joined = joined[joined["samples_per_s_ddp"].notna()]
    ties = [within_spread((r.samples_per_s_p25, r.samples_per_s_p75), (r.samples_per_s_p25_ddp, r.samples_per_s_p75_ddp))
            for r in joined.itertuples()]
    ratio = joined["samples_per_s"] / joined["samples_per_s_ddp"]
    verdict = ["" if tie is None else "tie" if tie else "faster" if r > 1 else "slower" for tie, r in zip(ties, ratio)]
    table = pd.DataFrame({
        "config": joined["label"],
        "ckpt": joined["ckpt"],
        # The micro-batch tells apart runs of one global batch reached with different accumulation.
        "micro": joined["micro_batch"],
        "batch": joined["global_batch"],
        "ranks": joined["world_size"],
        "samples/s vs DDP": ratio,
        # A tie where the two runs' per-step spreads overlap: the ratio is inside the noise.
        "within noise?": verdict,
        "peak memory vs DDP": joined["mem_peak_bytes"] / joined["mem_peak_bytes_ddp"],
    })
    if "compile" in joined and (joined["compile"] != "none").any():
        table.insert(2, "compile", joined["compile"])
    return with_model_column(table, joined, ["batch", "config", "ckpt"])


def comm_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per successful multi-rank run: the step's collectives, bus bytes measured and in theory."""
    ok = ok_runs(runs)
    if ok.empty or "comm.bus_bytes" not in ok:
        return pd.DataFrame()
    ok = ok[ok["world_size"] > 1]
    kinds = sorted({c.split(".")[2] for c in ok.columns if c.startswith("comm.collectives.") and c.endswith(".calls")})
    table = pd.DataFrame({"config": ok["label"], "ckpt": ok["ckpt"], "ranks": ok["world_size"]})
    for kind in kinds:
        calls = ok.get(f"comm.collectives.{kind}.calls")
        table[f"{kind} calls"] = calls.fillna(0).astype(int)
    table["bus MiB"] = ok["comm.bus_bytes"] / MIB
    table["theory MiB"] = ok["comm.theory.bus_bytes"] / MIB
    table["measured / theory"] = ok["comm.measured_over_theory"]
    table["theory"] = ok["comm.theory.formula"]
    return with_model_column(table, ok, ["config", "ckpt"])


def failures(runs: pd.DataFrame) -> pd.DataFrame:
    if runs.empty:
        return runs
    bad = runs[runs["status"] != "ok"]
    # One line each, records written before errors were (training/run.py describe_error) included.
    errors = bad["error"].fillna("").map(lambda e: str(e).strip().split("\n", 1)[0]) if "error" in bad else ""
    return pd.DataFrame({"run": bad["run_name"], "status": bad["status"], "error": errors})


def tracker_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Where each run logged with --tracker is also to be seen (training/trackers.py): its event files
    (tensorboard), its W&B run directory (what `wandb sync` takes), its metrics.csv."""
    if runs.empty or "config.run.tracker" not in runs:
        return pd.DataFrame()
    tracked = runs[runs["config.run.tracker"].fillna("").astype(str) != ""]
    rows = []
    for run in tracked.itertuples():
        record = Path(run.run_dir)
        names = str(tracked.loc[run.Index, "config.run.tracker"])
        for name in names.split(","):
            if name == "tensorboard":
                where = f"{record} (event files)"
            elif name == "wandb":
                found = sorted(record.glob("wandb/*run-*"))
                where = f"wandb sync {found[-1]}" if found else f"{record / 'wandb'} (no run written)"
            else:
                where = str(record / "metrics.csv")
            rows.append({"run": run.run_name, "tracker": name, "where": where})
    return pd.DataFrame(rows)


def max_batch_results(runs_dir: str | Path) -> list[dict]:
    """Every largest-batch search under `runs_dir` (one max_batch.json per budget)."""
    rows = []
    for path in sorted(Path(runs_dir).glob("max_batch/**/max_batch.json")):
        try:
            rows += json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"skipped {path}: not readable ({type(e).__name__})", file=sys.stderr)
    return rows


def max_batch_table(runs_dir: str | Path) -> pd.DataFrame:
    rows = max_batch_results(runs_dir)
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame({
        "config": [r["config"] for r in rows],
        "budget GiB": [r["budget_gb"] for r in rows],
        "largest micro-batch": [r["best_micro_batch"] for r in rows],
        "samples/s there": [r["samples_per_s"] for r in rows],
        "peak MiB there": [(r["mem_peak_bytes"] or np.nan) / MIB for r in rows],
        "probes": [len(r["probes"]) for r in rows],
    })


def markdown(table: pd.DataFrame, floatfmt: str = ".3g") -> str:
    if table.empty:
        return "_none_\n"
    return table.to_markdown(index=False, floatfmt=floatfmt) + "\n"


def budget_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One line per --ckpt_policy auto run that recorded its configuration (ok, oom or failed; one
    refused before it started has none): its budget, the plan it chose, the estimated and measured
    peaks, and its samples/s beside the fastest successful run of a hand-set policy (an interval, no
    plan) of the same model, preset, global batch, precision, ranks, backend configuration,
    micro-batch and compilation whose measured peak fits the same budget."""
    if runs.empty or "config.run.ckpt_policy" not in runs:
        return pd.DataFrame()
    auto = runs[runs["config.run.ckpt_policy"] == "auto"]
    if auto.empty:
        return pd.DataFrame()
    same = [*GROUP, "label", "micro_batch", *(["compile"] if "compile" in runs else [])]
    hand = ok_runs(runs)
    hand = hand[(hand["config.run.ckpt_policy"] != "auto")
                & (hand["config.run.ckpt_plan"].isna() if "config.run.ckpt_plan" in hand else True)]
    rows = []
    for _, run in auto.sort_values([*same, "config.run.mem_budget_gb"]).iterrows():
        budget = float(run["config.run.mem_budget_gb"]) * 2**30
        ok = run["status"] == "ok"
        peers = hand[np.logical_and.reduce([(hand[c] == run[c]) | (hand[c].isna() & pd.isna(run[c]))
                                            for c in same])] if not hand.empty else hand
        fits = peers[peers["mem_peak_bytes"] <= budget] if not peers.empty else peers
        best = fits.loc[fits["samples_per_s"].idxmax()] if not fits.empty else None
        rows.append({
            "model": run["model"], "config": run["label"], "ranks": run["world_size"], "micro": run["micro_batch"],
            "budget GiB": run["config.run.mem_budget_gb"], "status": run["status"],
            "plan": run["ckpt"].split(": ", 1)[-1] if ok else None,
            "estimate MiB": run.get("estimate.total_bytes", np.nan) / MIB if ok else np.nan,
            "peak MiB": run["mem_peak_bytes"] / MIB if pd.notna(run.get("mem_peak_bytes")) else np.nan,
            "peak / budget": run["mem_peak_bytes"] / budget if pd.notna(run.get("mem_peak_bytes")) else np.nan,
            "samples/s": run.get("samples_per_s") if ok else np.nan,
            "fastest hand-set that fits": best["ckpt"] if best is not None else None,
            "its samples/s": best["samples_per_s"] if best is not None else np.nan,
        })
    table = pd.DataFrame(rows)
    table["auto / it"] = table["samples/s"] / table["its samples/s"]
    return table


# What `python -m analysis.tables` prints: one line per run, whatever its status.
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
    parser = OneLineParser(prog="python -m analysis.tables", description="Print a comparison table of the runs under "
                                                                          "a directory.")
    parser.add_argument("runs_dir", help="directory of run records (searched recursively)")
    args = parser.parse_args(argv)
    try:
        table = comparison_table(args.runs_dir)
    except ConfigError as e:
        parser.error(str(e))
    print(table.to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
