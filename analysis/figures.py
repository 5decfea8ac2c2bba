"""seaborn figures of run records. Each function draws one figure and returns it (matplotlib)."""

from __future__ import annotations

# No backend is chosen here: the report CLI picks Agg (files only), a notebook keeps its inline one.
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from analysis.tables import MIB, ok_runs

sns.set_theme(style="whitegrid", context="notebook")


def _empty(title: str):
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.text(0.5, 0.5, "no successful runs to show", ha="center", va="center")
    ax.set_axis_off()
    ax.set_title(title)
    return fig


def throughput_and_memory(runs: pd.DataFrame):
    """(a) samples/s, and average and peak memory, per backend configuration (the article's figure)."""
    ok = ok_runs(runs)
    if ok.empty:
        return _empty("Throughput and memory per backend")
    ok["peak MiB"] = ok["mem_peak_bytes"] / MIB
    ok["average MiB"] = ok["mem_avg_bytes"] / MIB
    order = sorted(ok["label"].unique())
    fig, axes = plt.subplots(1, 2, figsize=(14, max(4, 0.35 * len(order) + 2)), sharey=True)
    sns.barplot(ok, y="label", x="samples_per_s", hue="ckpt", order=order, ax=axes[0], errorbar=None)
    axes[0].set(xlabel="samples/s", ylabel="", title="Throughput")
    memory = ok.melt(id_vars=["label", "ckpt"], value_vars=["peak MiB", "average MiB"], var_name="memory",
                     value_name="MiB")
    memory["series"] = memory["memory"] + ", ckpt " + memory["ckpt"]
    sns.barplot(memory, y="label", x="MiB", hue="series", order=order, ax=axes[1], errorbar=None)
    axes[1].set(xlabel="MiB per rank", ylabel="", title="Memory (peak and average)")
    for ax in axes:
        ax.legend(fontsize="x-small", bbox_to_anchor=(0.5, -0.08), loc="upper center", ncol=2)
    fig.tight_layout()
    return fig


def memory_vs_batch(runs: pd.DataFrame, limit_bytes: float | None = None):
    """(b) peak memory against micro-batch, with and without checkpointing; the limit as a line."""
    ok = ok_runs(runs)
    if ok.empty:
        return _empty("Peak memory against micro-batch")
    ok["peak MiB"] = ok["mem_peak_bytes"] / MIB
    fig, ax = plt.subplots(figsize=(8, 5))
    sns.lineplot(ok, x="micro_batch", y="peak MiB", hue="label", style="ckpt", markers=True, ax=ax,
                 errorbar=None)
    if limit_bytes:
        ax.axhline(limit_bytes / MIB, color="black", linestyle="--", label="memory limit")
        ax.legend(fontsize="small")
    ax.set(xscale="log", xlabel="micro-batch per rank", ylabel="peak MiB per rank", title="Peak memory against batch")
    fig.tight_layout()
    return fig


def throughput_vs_batch(runs: pd.DataFrame):
    """(c) samples/s against micro-batch."""
    ok = ok_runs(runs)
    if ok.empty:
        return _empty("Throughput against micro-batch")
    fig, ax = plt.subplots(figsize=(8, 5))
    sns.lineplot(ok, x="micro_batch", y="samples_per_s", hue="label", style="ckpt", markers=True, ax=ax,
                 errorbar=None)
    ax.set(xscale="log", xlabel="micro-batch per rank", ylabel="samples/s", title="Throughput against batch")
    fig.tight_layout()
    return fig


def pareto_points(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs no other run beats on both peak memory (lower) and samples/s (higher)."""
    ok = ok_runs(runs).dropna(subset=["mem_peak_bytes", "samples_per_s"]).sort_values(
        ["mem_peak_bytes", "samples_per_s"], ascending=[True, False])
    best, keep = -1.0, []
    for index, rate in ok["samples_per_s"].items():
        if rate > best:
            keep.append(index)
            best = rate
    return ok.loc[keep]


def pareto(runs: pd.DataFrame):
    """(d) peak memory against samples/s, with the Pareto frontier."""
    ok = ok_runs(runs)
    if ok.empty:
        return _empty("Memory-throughput Pareto frontier")
    ok["peak MiB"] = ok["mem_peak_bytes"] / MIB
    front = pareto_points(ok)
    fig, ax = plt.subplots(figsize=(9, 6))
    sns.scatterplot(ok, x="peak MiB", y="samples_per_s", hue="label", style="ckpt", s=70, ax=ax)
    ax.plot(front["mem_peak_bytes"] / MIB, front["samples_per_s"], color="black", linestyle="--",
            label="Pareto frontier")
    ax.legend(fontsize="x-small", bbox_to_anchor=(1.02, 1), loc="upper left")
    ax.set(xlabel="peak MiB per rank (lower is better)", ylabel="samples/s (higher is better)",
           title="Memory against throughput")
    fig.tight_layout()
    return fig


def loss_curves(metrics: pd.DataFrame, runs: pd.DataFrame):
    """(e) every run's per-step loss overlaid: equal curves mean equal training."""
    if metrics.empty:
        return _empty("Loss curves")
    labels = runs.set_index("run_name")[["label", "ckpt"]]
    data = metrics.join(labels, on="run_name")
    data["run"] = data["label"] + ", ckpt " + data["ckpt"]
    fig, ax = plt.subplots(figsize=(9, 5))
    sns.lineplot(data, x="step", y="loss", hue="run", ax=ax, linewidth=1, alpha=0.7, legend=len(runs) <= 20)
    if ax.get_legend():
        ax.legend(fontsize="x-small", bbox_to_anchor=(1.02, 1), loc="upper left")
    ax.set(title="Loss per step (mean over the global batch)")
    fig.tight_layout()
    return fig
