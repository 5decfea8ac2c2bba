"""Run records: the documented schema, memory accounting, and no truncated JSON ever."""

import json
import os
import re

import pytest

from conftest import REPO, train
from core.records import atomic_write_json, atomic_write_text

README = REPO / "runs" / "README.md"


def documented_fields(section: str) -> set[str]:
    """The backticked names in the first column of the table under `## <section>` in runs/README.md."""
    text = README.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z0-9_]+)` \|", body, flags=re.M))


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    return train(runs, "schema", "--preset", "tiny", "--steps", "5", "--micro_batch", "4", "--grad_accum", "2",
                 "--warmup_steps", "1", "--mem_profile_steps", "1", "--eval_every", "2").check_ok()


@pytest.mark.launch
def test_summary_has_exactly_the_documented_fields(record):
    assert set(record.summary) == documented_fields("summary.json")


@pytest.mark.launch
def test_config_has_exactly_the_documented_fields(record):
    assert set(record.config) == documented_fields("config.json")
    env = record.config["environment"]
    assert env["versions"]["torch"] and env["host"] and env["device_name"]
    assert record.config["world_size"] == 1


@pytest.mark.launch
def test_metrics_lines_have_the_documented_fields(record):
    documented = documented_fields("metrics.jsonl")
    lines = record.metrics
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]
    for line in lines:
        assert set(line) == documented - {"val_loss"} or set(line) == documented
    # --eval_every 2 evaluates after steps 1 and 3, and the last step always.
    assert [m["step"] for m in lines if "val_loss" in m] == [1, 3, 4]
    # Warm-up step 0 and the profiled last step are not timed.
    assert [m["timed"] for m in lines] == [False, True, True, True, False]


@pytest.mark.launch
def test_summary_values_are_consistent(record):
    s = record.summary
    assert s["status"] == "ok" and s["error"] is None
    assert s["global_batch"] == s["micro_batch"] * s["grad_accum"] * s["world_size"] == 8
    assert s["timed_steps"] == 3 and s["samples_per_s"] > 0
    # The spread: quartiles of the 3 timed steps' rates around their median (unequal in real timing).
    assert 0 < s["samples_per_s_p25"] <= s["samples_per_s"] <= s["samples_per_s_p75"]
    assert s["samples_per_s_p25"] < s["samples_per_s_p75"]
    assert s["tokens_per_s"] == pytest.approx(s["samples_per_s"] * record.config["model"]["block_size"])
    assert s["final_loss"] == record.metrics[-1]["loss"]
    assert s["mfu"] is None  # no known peak FLOP/s for a CPU
    assert s["mem_source"] == "torch_profiler" and s["mem_peak_bytes"] > 0


@pytest.mark.launch
def test_model_state_bytes_and_memory_breakdown_agree_with_the_model(record):
    s = record.summary
    param_bytes = s["n_params"] * 4  # fp32
    states = s["model_state_bytes"]
    assert states["params"] == states["grads"] == param_bytes
    # AdamW: exp_avg and exp_avg_sq per parameter, plus one scalar step per parameter tensor.
    assert 2 * param_bytes <= states["optimizer"] <= 2 * param_bytes + 4 * 64
    assert states["params_gathered"] == 0
    assert states["total"] == states["params"] + states["grads"] + states["optimizer"]
    breakdown = s["mem_breakdown"]
    assert breakdown["parameter"] == param_bytes
    assert breakdown["optimizer_state"] == states["optimizer"]
    assert breakdown["activation"] > 0
    assert sum(breakdown.values()) == s["mem_peak_bytes"]


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"status": "running"})

    def crash(*args):
        raise KeyboardInterrupt  # as if the process died between writing and renaming

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_json(path, {"status": "ok", "padding": "x" * 100_000})
    assert json.loads(path.read_text()) == {"status": "running"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left behind


def test_json_records_are_strict_json(tmp_path):
    atomic_write_json(tmp_path / "s.json", {"loss": float("nan"), "nested": [float("inf")]})
    assert json.loads((tmp_path / "s.json").read_text(), parse_constant=lambda c: pytest.fail(c)) == {
        "loss": None, "nested": [None]}
    atomic_write_text(tmp_path / "t.txt", "a")
    assert oct((tmp_path / "t.txt").stat().st_mode & 0o777) == "0o644"


@pytest.mark.launch
def test_documented_categories_are_the_profilers(record):
    readme = README.read_text()
    for category in record.summary["mem_breakdown"]:
        assert f"`{category}`" in readme, category
