"""The analysis package on real sweep records, plus failed, oom and killed ones."""

import os
import shutil

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from analysis import figures, load_metrics, load_runs, tables
from conftest import REPO, in_process
from core.records import atomic_write_json

# The tests reading `mixed` are in the distributed tier: the quick matrix is real 2-rank launches.


@pytest.fixture(scope="module")
def mixed(launches, request, tmp_path_factory):
    """The quick matrix's records plus a failed, an oom and a killed (still "running") record."""
    root = tmp_path_factory.mktemp("mixed")
    shutil.copytree(launches.get("matrix", request), root, dirs_exist_ok=True)
    for name, status, error in (("broken", "failed", "rank 1: RuntimeError: boom"),
                                ("too-big", "oom", "rank 0: OutOfMemoryError: CUDA out of memory"),
                                ("killed", "running", None)):
        atomic_write_json(root / name / "summary.json", {"schema_version": 1, "run_name": name, "status": status,
                                                         "backend": "ddp", "world_size": 2, "error": error})
    return root


def test_a_ddp_run_with_its_own_buckets_is_labelled_apart_from_ddp():
    from analysis.runs import config_label

    assert config_label("ddp") == "ddp"
    assert config_label("ddp", ddp_bucket_cap_mb=6.25) == "ddp.bucket_6.25mb"
    assert config_label("ddp", ddp_bucket_cap_mb=float("nan")) == "ddp"  # a record from before the flag, in a frame
    assert config_label("fsdp", "fsdp_configs/full_shard.yaml") == "fsdp.full_shard"


@pytest.mark.distributed
def test_load_runs_keeps_every_status(mixed):
    runs = load_runs(mixed)
    counts = runs["status"].value_counts().to_dict()
    assert counts == {"ok": 30, "failed": 1, "oom": 1, "running": 1}
    assert runs.loc[runs["run_name"] == "too-big", "error"].item().startswith("rank 0: OutOfMemoryError")
    ok = runs[runs["status"] == "ok"]
    # Summary and config flattened into columns.
    assert ok["config.run.micro_batch"].eq(ok["micro_batch"]).all() and "mem_breakdown.activation" in runs
    assert {"single", "ddp", "fsdp.full_shard", "fsdp2.fsdp2", "deepspeed.z3"} <= set(runs["label"])


@pytest.mark.distributed
def test_ddp_ratios(mixed):
    ratios = tables.ddp_ratios(load_runs(mixed))
    ddp = ratios[(ratios["config"] == "ddp") & (ratios["ckpt"] == "none")]
    assert ddp["samples/s vs DDP"].tolist() == [1.0] and ddp["peak memory vs DDP"].tolist() == [1.0]
    assert set(ratios["config"]) >= {"fsdp.full_shard", "deepspeed.z2"}  # single (1 rank) has no DDP twin
    assert "single" not in set(ratios["config"])


@pytest.mark.distributed
def test_pareto_points_are_not_dominated(mixed):
    runs = tables.ok_runs(load_runs(mixed))
    front = figures.pareto_points(runs)
    for _, p in front.iterrows():
        dominated = runs[(runs["mem_peak_bytes"] <= p["mem_peak_bytes"]) & (runs["samples_per_s"] > p["samples_per_s"])]
        assert dominated.empty


def _is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


@pytest.mark.distributed
def test_report_writes_markdown_and_every_figure(mixed, tmp_path):
    out = tmp_path / "report"
    from analysis import report

    proc = in_process(report.main, [mixed, "--out", out])  # the logic; tests/unit/test_trust.py runs the CLI as a process
    assert proc.returncode == 0, proc.stderr
    report = (out / "report.md").read_text()
    for section in ("## Runs", "## Against DDP", "## Runs that did not succeed", "## Figures"):
        assert section in report
    assert "rank 1: RuntimeError: boom" in report and "estimate MiB" in report
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 6 and all(_is_png(p) for p in pngs)
    for png in pngs:
        assert f"]({png.name})" in report


@pytest.mark.distributed
@pytest.mark.parametrize("draw", ["throughput_and_memory", "memory_vs_batch", "throughput_vs_batch", "pareto",
                                  "ckpt_frontier", "loss_curves"])
def test_every_figure_renders_to_a_png(mixed, tmp_path, draw):
    runs = load_runs(mixed)
    fig = (figures.loss_curves(load_metrics(mixed), runs) if draw == "loss_curves"
           else getattr(figures, draw)(runs))
    fig.savefig(tmp_path / "f.png")
    assert _is_png(tmp_path / "f.png")
    # Nothing to show still gives a (labelled) figure rather than an error.
    empty = pd.DataFrame(columns=runs.columns)
    (figures.loss_curves(pd.DataFrame(), empty) if draw == "loss_curves" else getattr(figures, draw)(empty)).savefig(
        tmp_path / "e.png")
    assert _is_png(tmp_path / "e.png")


@pytest.mark.distributed
def test_notebook_executes(mixed):
    nb = nbformat.read(REPO / "analysis" / "compare.ipynb", as_version=4)
    os.environ["GPTLITE_RUNS_DIR"] = str(mixed)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        del os.environ["GPTLITE_RUNS_DIR"]
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 5


def test_checkpointing_label_names_the_activation_offload():
    from analysis.runs import ckpt_label

    base = {"ckpt_interval": 1, "config.run.ckpt_impl": "torch_nonreentrant"}
    assert ckpt_label({"ckpt_interval": 0}) == "none"
    assert ckpt_label(base) == "every 1 (torch_nonreentrant)"
    assert ckpt_label({**base, "config.run.ckpt_offload": True}) == "every 1 (torch_nonreentrant, torch offload)"
    assert ckpt_label({**base, "config.run.offload_activations": True,
                       "config.run.activation_loading_horizon": 4}) == (
        "every 1 (torch_nonreentrant, prefetch offload H=4)")
    # The policy: selective runs are not labelled as the full ones of the same interval.
    assert ckpt_label({**base, "config.run.ckpt_policy": "full"}) == "every 1 (torch_nonreentrant)"
    assert ckpt_label({**base, "config.run.ckpt_policy": "selective"}) == "every 1 (torch_nonreentrant, selective)"
    assert ckpt_label({**base, "config.run.ckpt_policy": "selective", "config.run.ckpt_save_ops": "mm,bmm"}) == (
        "every 1 (torch_nonreentrant, selective keeping mm,bmm)")
