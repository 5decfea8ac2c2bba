"""The articles' claims checked against run records: checkpointing's cost and the memory it frees,
the throughput a larger batch buys, activation offload, the order of the backends.

    python -m analysis.claims runs/reference/nvidia-h100-80gb-hbm3 --out reports/h100_claims

Writes claims.md (one table per claim, each beside what the articles report) and one figure per
claim. Runs are compared only within one model (its label and settings), precision and device: a
directory holding several gets one set of tables per group. The records decide what can be said:
a claim without the runs it needs is left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from analysis import compact
from analysis.runs import load_runs, require_records
from analysis.tables import markdown, ok_runs
from backends import DDP, REFERENCE
from gptlite.errors import ConfigError
from training.cli import OneLineParser
from training.preflight import writable_out

GIB = 2**30
PLAIN_CKPT = ("none", "every 1 (torch_nonreentrant)")  # no activation offload


def _plain(runs: pd.DataFrame, label: str = REFERENCE) -> pd.DataFrame:  # a backend's label is its name
    ok = ok_runs(runs)
    return ok[(ok["label"] == label) & ok["ckpt"].isin(PLAIN_CKPT)]


def checkpointing(runs: pd.DataFrame) -> pd.DataFrame:
    """Per micro-batch measured both ways: the slowdown and the peak memory freed by
    checkpointing every block (the articles: 20-25% slower; 33-38% less memory for T5)."""
    plain = _plain(runs).groupby(["micro_batch", "ckpt"])[["samples_per_s", "mem_peak_bytes"]].median().unstack()
    rows = []
    if not {("samples_per_s", "none"), ("samples_per_s", PLAIN_CKPT[1])} <= set(plain.columns):
        return pd.DataFrame()  # runs of one kind only: nothing to compare
    for micro, row in plain.iterrows():
        if row.isna().any():
            continue
        fast, slow = row[("samples_per_s", "none")], row[("samples_per_s", PLAIN_CKPT[1])]
        big, small = row[("mem_peak_bytes", "none")], row[("mem_peak_bytes", PLAIN_CKPT[1])]
        rows.append({"micro-batch": micro, "samples/s none": fast, "samples/s ckpt": slow,
                     "slowdown": 1 - slow / fast, "peak GiB none": big / GIB, "peak GiB ckpt": small / GIB,
                     "memory freed": 1 - small / big})
    return pd.DataFrame(rows)


def largest_batch(runs: pd.DataFrame) -> pd.DataFrame:
    """The largest micro-batch that ran with and without checkpointing, the smallest that ran out
    of memory, and the samples/s at the largest (the articles: 2-3x from the larger batch)."""
    scan = runs[(runs["label"] == REFERENCE) & runs["ckpt"].isin(PLAIN_CKPT)]
    rows = []
    for ckpt, group in scan.groupby("ckpt"):
        ok = group[group["status"] == "ok"]
        oom = group[group["status"] == "oom"]
        if ok.empty:
            continue
        best = ok.loc[ok["micro_batch"].idxmax()]
        rows.append({"ckpt": ckpt, "largest that ran": int(best["micro_batch"]),
                     "smallest out of memory": int(oom["micro_batch"].min()) if not oom.empty else None,
                     "peak GiB": best["mem_peak_bytes"] / GIB, "samples/s": best["samples_per_s"],
                     "best samples/s at any batch": ok["samples_per_s"].max()})
    table = pd.DataFrame(rows)
    if len(table) == 2:
        table["vs none"] = table["samples/s"] / table.loc[table["ckpt"] == "none", "samples/s"].iloc[0]
    return table


def activation_offload(runs: pd.DataFrame) -> pd.DataFrame:
    """Checkpointing with the saved inputs kept, offloaded by torch, offloaded with prefetch."""
    ok = ok_runs(runs)
    ok = ok[(ok["label"] == REFERENCE) & (ok["ckpt_interval"] > 0)]
    offload_micro = ok.loc[ok["ckpt"] != PLAIN_CKPT[1], "micro_batch"].unique()
    ok = ok[ok["micro_batch"].isin(offload_micro)]
    table = ok.groupby(["micro_batch", "ckpt"])[["samples_per_s", "mem_peak_bytes"]].median().reset_index()
    table["peak GiB"] = table.pop("mem_peak_bytes") / GIB
    kept = table.set_index("micro_batch").query("ckpt == @PLAIN_CKPT[1]")
    if not kept.empty:
        base = table["micro_batch"].map(kept["samples_per_s"])
        table["samples/s vs kept"] = table["samples_per_s"] / base
        table["peak vs kept"] = table["peak GiB"] / table["micro_batch"].map(kept["peak GiB"])
    return table.rename(columns={"micro_batch": "micro-batch", "samples_per_s": "samples/s"})


def backends(runs: pd.DataFrame) -> pd.DataFrame:
    """Every backend configuration at the most common micro-batch: samples/s, MFU, peak."""
    ok = ok_runs(runs)
    ok = ok[ok["ckpt"].isin(PLAIN_CKPT)]
    if ok.empty:
        return pd.DataFrame()
    micro = ok.groupby("micro_batch")["label"].nunique().idxmax()
    ok = ok[ok["micro_batch"] == micro]
    table = ok.groupby(["label", "ckpt"])[["samples_per_s", "mfu", "mem_peak_bytes"]].median().reset_index()
    table["peak GiB"] = table.pop("mem_peak_bytes") / GIB
    ddp = table[table["label"] == DDP].set_index("ckpt")["samples_per_s"]
    if not ddp.empty:
        table["samples/s vs DDP"] = table["samples_per_s"] / table["ckpt"].map(ddp)
    table.insert(0, "micro-batch", micro)
    return table.sort_values(["ckpt", "samples_per_s"], ascending=[True, False]).rename(
        columns={"label": "config", "samples_per_s": "samples/s"})


def _figures(runs: pd.DataFrame, out: Path) -> dict[str, str]:
    drawn = {}
    plain = _plain(runs).assign(peak_gib=lambda d: d["mem_peak_bytes"] / GIB)
    if not plain.empty:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        sns.lineplot(plain, x="micro_batch", y="samples_per_s", hue="ckpt", marker="o", ax=axes[0], errorbar=None)
        sns.lineplot(plain, x="micro_batch", y="peak_gib", hue="ckpt", marker="o", ax=axes[1], errorbar=None)
        axes[0].set(xscale="log", xlabel="micro-batch", ylabel="samples/s", title="Throughput")
        axes[1].set(xscale="log", xlabel="micro-batch", ylabel="peak GiB", title="Peak memory")
        fig.tight_layout()
        drawn["checkpointing.png"] = "Checkpointing every block against none, by micro-batch (single)"
        fig.savefig(out / "checkpointing.png", dpi=110)
        plt.close(fig)
    table = backends(runs)
    if not table.empty:
        fig, axes = plt.subplots(1, 2, figsize=(12, 0.3 * len(table) + 2), sharey=True)
        order = table[table["ckpt"] == "none"].sort_values("samples/s", ascending=False)["config"]
        sns.barplot(table, y="config", x="samples/s", hue="ckpt", order=order, ax=axes[0])
        sns.barplot(table, y="config", x="peak GiB", hue="ckpt", order=order, ax=axes[1])
        for ax in axes:
            ax.legend(fontsize="small")
        fig.tight_layout()
        drawn["backends.png"] = "Every backend configuration at one micro-batch: throughput and peak memory"
        fig.savefig(out / "backends.png", dpi=110)
        plt.close(fig)
    table = activation_offload(runs)
    if len(table) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(12, 3), sharey=True)
        sns.barplot(table, y="ckpt", x="samples/s", ax=axes[0])
        sns.barplot(table, y="ckpt", x="peak GiB", ax=axes[1])
        axes[0].set(ylabel="")
        fig.tight_layout()
        drawn["activation_offload.png"] = "Activation offload: saved inputs kept, torch's offload, prefetch at H"
        fig.savefig(out / "activation_offload.png", dpi=110)
        plt.close(fig)
    return drawn


# What makes two runs comparable: the same model (its label and settings: analysis/runs.py model_key,
# GPT-lite's preset included), precision and device. (World sizes meet in the backends' table: the
# single process beside the 2-rank backends, each row saying which it is by its configuration.)
COMPARABLE = ("model", "preset", "precision", "device_name")
SECTIONS = (("Checkpointing every block: slowdown and memory freed", checkpointing),
            ("The largest micro-batch, and what it buys", largest_batch),
            ("Activation offload", activation_offload),
            ("Backends at one micro-batch", backends))


def comparable_groups(runs: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The runs cut into groups that may be compared, each with its name (what sets it apart from
    the others; "" where there is one group)."""
    keys = [k for k in COMPARABLE if k in runs]
    groups = list(runs.groupby(keys, dropna=False, sort=True)) if keys else [((), runs)]
    varying = [k for k in keys if runs[k].nunique(dropna=False) > 1]
    named = []
    for key, group in groups:
        values = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        named.append((", ".join(f"{k} {values[k]}" for k in varying), group))
    return named


def write_claims(runs_dir: str | Path, out: str | Path) -> Path:
    runs_dir, out = Path(runs_dir), Path(out)
    runs = require_records(load_runs(runs_dir), runs_dir)
    out.mkdir(parents=True, exist_ok=True)
    devices = ", ".join(sorted(set(runs["device_name"].dropna())))
    lines = [f"# Claims against {runs_dir.name}", "", f"{len(runs)} runs on {devices or 'unknown device'} "
             "(`python -m analysis.claims`).", ""]
    groups = comparable_groups(runs)
    for k, (name, group) in enumerate(groups):
        if name:
            lines += [f"# {name}", ""]
        for title, section in SECTIONS:
            table = section(group)
            if not table.empty:
                lines += [f"## {title}", "", markdown(table)]
        drawn = out / (f"group{k + 1}" if len(groups) > 1 else "")
        drawn.mkdir(exist_ok=True)
        for figure, caption in _figures(group, drawn).items():
            path = (drawn / figure).relative_to(out)
            lines += [f"### {caption}", "", f"![{caption}]({path})", ""]
    path = out / "claims.md"
    path.write_text("\n".join(lines))
    return path


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m analysis.claims", description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir", help="directory of run records (searched recursively)")
    parser.add_argument("--out", required=True, help="directory for claims.md and its figures")
    args = parser.parse_args(argv)
    if not compact.is_dir(args.runs_dir):  # a folder, or one inside a compact folder (analysis/compact.py)
        parser.error(f"runs_dir {args.runs_dir} is not a directory")
    try:
        writable_out("--out", args.out)
    except ConfigError as e:
        parser.error(str(e))
    matplotlib.use("Agg")
    try:
        print(write_claims(args.runs_dir, args.out))
    except ConfigError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
