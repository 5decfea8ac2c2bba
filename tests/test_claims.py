"""analysis.claims on the committed GPU reference records (no launches: fast)."""

import json

import pytest

from analysis import claims, load_runs
from conftest import REPO

REFERENCE = REPO / "runs" / "reference" / "nvidia-h100-80gb-hbm3"


@pytest.fixture(scope="module")
def runs():
    return load_runs(REFERENCE)


def _summary(sweep: str, name: str) -> dict:
    return json.loads((REFERENCE / sweep / name / "summary.json").read_text())


def test_checkpointing_slowdown_and_memory_freed_come_from_the_records(runs):
    table = claims.checkpointing(runs).set_index("micro-batch")
    none = _summary("gpu_reference_batch", "single-w1-paper-mb32-bf16-ckpt0")
    ckpt = _summary("gpu_reference_batch", "single-w1-paper-mb32-bf16-ckpt1-torch_nonreentrant")
    row = table.loc[32]
    assert row["slowdown"] == pytest.approx(1 - ckpt["samples_per_s"] / none["samples_per_s"])
    assert row["memory freed"] == pytest.approx(1 - ckpt["mem_peak_bytes"] / none["mem_peak_bytes"])
    assert list(table.index) == [8, 16, 32, 64]  # 128 and 256 ran only with checkpointing


def test_largest_batch_names_the_first_batch_out_of_memory(runs):
    table = claims.largest_batch(runs).set_index("ckpt")
    assert table.loc["none", "largest that ran"] == 64 and table.loc["none", "smallest out of memory"] == 128
    assert table.loc["every 1 (torch_nonreentrant)", "largest that ran"] == 256


def test_backends_are_compared_with_ddp_at_one_batch(runs):
    table = claims.backends(runs)
    assert set(table["micro-batch"]) == {8}
    ddp = table[(table["config"] == "ddp") & (table["ckpt"] == "none")]
    assert ddp["samples/s vs DDP"].item() == pytest.approx(1.0)
    assert len(table) == 30


def test_write_claims_writes_every_section_and_figure(runs, tmp_path):
    path = claims.write_claims(REFERENCE, tmp_path)
    text = path.read_text()
    for title in ("Checkpointing every block", "largest micro-batch", "Activation offload", "Backends"):
        assert title in text
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["activation_offload.png", "backends.png",
                                                                "checkpointing.png"]
