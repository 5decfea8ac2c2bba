"""analysis.claims on the committed GPU reference records (no launches: fast). What its tables must
say of them is in runs/reference/index.yaml (tests/unit/test_reference.py); here, how they are made."""

import json

import pytest

from analysis import claims, compact, load_runs
from conftest import REPO

REFERENCE = REPO / "runs" / "reference" / "nvidia-h100-80gb-hbm3"  # a compact folder (analysis/compact.py)


@pytest.fixture(scope="module")
def runs():
    return load_runs(REFERENCE)


def _summary(sweep: str, name: str) -> dict:
    return compact.read_json(REFERENCE / sweep / name / "summary.json")


def test_checkpointing_slowdown_and_memory_freed_come_from_the_records(runs):
    table = claims.checkpointing(runs).set_index("micro-batch")
    none = _summary("gpu_reference_batch", "single-w1-paper-mb32-bf16-ckpt0")
    ckpt = _summary("gpu_reference_batch", "single-w1-paper-mb32-bf16-ckpt1-torch_nonreentrant")
    row = table.loc[32]
    assert row["slowdown"] == pytest.approx(1 - ckpt["samples_per_s"] / none["samples_per_s"])
    assert row["memory freed"] == pytest.approx(1 - ckpt["mem_peak_bytes"] / none["mem_peak_bytes"])
    assert list(table.index) == [8, 16, 32, 64]  # 128 and 256 ran only with checkpointing


def test_backends_are_compared_with_ddp_at_one_batch(runs):
    table = claims.backends(runs)
    assert set(table["micro-batch"]) == {8}
    ddp = table[(table["config"] == "ddp") & (table["ckpt"] == "none")]
    assert ddp["samples/s vs DDP"].item() == pytest.approx(1.0)


def test_write_claims_writes_every_section_and_figure(runs, tmp_path):
    path = claims.write_claims(REFERENCE, tmp_path)
    text = path.read_text()
    for title in ("Checkpointing every block", "largest micro-batch", "Activation offload", "Backends"):
        assert title in text
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["activation_offload.png", "backends.png",
                                                                "checkpointing.png"]


def _copy(sweep: str, to, n_layer: int | None = None, only_plain: bool = False) -> None:
    """The reference sweep's records written out under `to` (compact.unpack: a records folder on disk);
    with n_layer, as if they had trained that size of GPT-lite (a second model); only_plain: the runs
    without checkpointing only."""
    for record in compact.iterdir(REFERENCE / sweep):
        if not compact.is_file(record / "summary.json") or (only_plain and "ckpt0" not in record.name):
            continue
        compact.unpack(record, to / record.name)
        if n_layer is not None:
            config = json.loads((to / record.name / "config.json").read_text())
            config["run"]["n_layer"] = n_layer
            (to / record.name / "config.json").write_text(json.dumps(config))


def test_a_directory_without_checkpointing_runs_gives_the_claims_it_can(tmp_path):
    _copy("gpu_reference_batch", tmp_path / "runs", only_plain=True)
    text = claims.write_claims(tmp_path / "runs", tmp_path / "out").read_text()
    assert "largest micro-batch" in text and "Checkpointing every block: slowdown" not in text


def test_two_models_in_one_directory_are_never_pooled(tmp_path, runs):
    """The same records twice, once as another size of GPT-lite: each model gets its own tables,
    holding its own runs only (the medians were taken over both)."""
    _copy("gpu_reference_batch", tmp_path / "runs" / "a")
    _copy("gpu_reference_batch", tmp_path / "runs" / "b", n_layer=2)
    both = load_runs(tmp_path / "runs")
    groups = dict(claims.comparable_groups(both))
    assert set(groups) == {"model gptlite", "model gptlite n_layer=2"}
    assert all(len(group) == len(both) // 2 for group in groups.values())
    text = claims.write_claims(tmp_path / "runs", tmp_path / "out").read_text()
    assert text.count("\n## Checkpointing every block:") == 2 and "\n# model gptlite n_layer=2\n" in text
