"""seaborn figures of run records. Each function draws one figure and returns it (matplotlib)."""

from __future__ import annotations

import textwrap

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


def policy_family(ckpt: str) -> str:
    """The checkpointing policy of a run's `ckpt` label (analysis.runs.ckpt_label), without its interval
    or budget: none, full, selective, full + offload, plan, auto."""
    if ckpt.startswith("auto "):
        return "auto (budget)"
    if ckpt.startswith("plan "):
        return "plan"
    if ckpt == "none":
        return "none"
    if "selective" in ckpt:
        return "selective every k"
    return "full every k + offload" if "offload" in ckpt else "full every k"


def _point_label(ckpt: str) -> str:
    """A short label beside a point: "k=2" for every 2, the budget for auto, nothing for none."""
    if ckpt.startswith("auto "):
        return ckpt.split(":", 1)[0].removeprefix("auto ")
    if ckpt.startswith("every "):
        return "k=" + ckpt.split()[1]
    return ""


def policy_panels(runs: pd.DataFrame) -> pd.DataFrame:
    """One point per model, backend configuration and checkpointing label among successful runs, for
    the configurations run under more than one checkpointing policy: the median samples/s and the
    largest measured peak over repeats, its policy family, and whether it is on its panel's Pareto
    frontier (no other point of the panel has a lower or equal peak and more samples/s)."""
    ok = ok_runs(runs).dropna(subset=["mem_peak_bytes", "samples_per_s"])
    if ok.empty:
        return pd.DataFrame()
    ok["panel"] = ok["model"].astype(str) + " " + ok["label"].astype(str) + ", " + ok["world_size"].astype(str) \
        + " rank(s), micro-batch " + ok["micro_batch"].astype(str)
    points = ok.groupby(["panel", "ckpt"], as_index=False).agg(
        samples_per_s=("samples_per_s", "median"), mem_peak_bytes=("mem_peak_bytes", "max"), runs=("run_name", "size"))
    points = points[points.groupby("panel")["ckpt"].transform("nunique") > 1].copy()
    points["policy"] = points["ckpt"].map(policy_family)
    points["front"] = False
    for _, panel in points.groupby("panel"):
        points.loc[pareto_points(panel.assign(status="ok")).index, "front"] = True
    return points


def ckpt_frontier(runs: pd.DataFrame):
    """(f) per model and backend configuration, peak memory against samples/s for each checkpointing
    policy (none, full and selective every k, auto at each budget), with the panel's Pareto frontier."""
    points = policy_panels(runs)
    if points.empty:
        return _empty("Checkpointing policies: memory against throughput")
    panels = sorted(points["panel"].unique())
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.8 * rows), squeeze=False)
    order = [p for p in ("none", "full every k", "selective every k", "full every k + offload", "plan", "auto (budget)")
             if p in set(points["policy"])]
    for ax, panel in zip(axes.flat, panels):
        data = points[points["panel"] == panel].assign(**{"peak MiB": lambda d: d["mem_peak_bytes"] / MIB})
        sns.scatterplot(data, x="peak MiB", y="samples_per_s", hue="policy", style="policy", hue_order=order,
                        style_order=order, s=80, ax=ax, legend=ax is axes.flat[0])
        front = data[data["front"]].sort_values("peak MiB")
        ax.step(front["peak MiB"], front["samples_per_s"], where="post", color="black", linestyle="--", linewidth=1,
                label="Pareto frontier")
        for _, point in data.iterrows():
            ax.annotate(_point_label(point["ckpt"]), (point["peak MiB"], point["samples_per_s"]), fontsize="x-small",
                        xytext=(4, 3), textcoords="offset points")
        ax.set(title=textwrap.fill(panel, 80), xlabel="peak MiB per rank (lower is better)", ylabel="samples/s (median)")
        ax.title.set_fontsize("small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    if axes.flat[0].get_legend():
        axes.flat[0].legend(fontsize="x-small", loc="lower right")
    fig.suptitle("Checkpointing policies: memory against throughput (auto labelled with its budget, every k with k)")
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
