"""--tracker: TensorBoard, W&B (offline) and CSV get the record's own metric lines, read back with each
tool's own reader; settings that could not start are refused in one line before anything runs."""

from __future__ import annotations

import csv
import json
import math
import struct
from pathlib import Path

import pytest
import yaml

from core.config import RunConfig
from core.records import read_jsonl
from gptlite.errors import ConfigError
from training import trackers
from training.cli import build_parser

tensorboard = pytest.importorskip("tensorboard", reason="tensorboard is in the dev extras (pip install -e '.[dev]')")
wandb = pytest.importorskip("wandb", reason="wandb is in the dev extras (pip install -e '.[dev]')")

STEPS = 5


# ---------------------------------------------------------------- unit: the flag and its checks

def test_tracker_is_repeatable_comma_separated_and_each_name_once():
    ns = build_parser().parse_args(["--tracker", "tensorboard", "--tracker", "csv,tensorboard"])
    assert RunConfig(**vars(ns)).tracker == "tensorboard,csv"
    assert RunConfig(tracker="wandb, csv").tracker == "wandb,csv"
    assert RunConfig().tracker is None
    with pytest.raises(ConfigError, match=r"tracker must be one of tensorboard, wandb, csv \(got 'mlflow'\)"):
        RunConfig(tracker="tensorboard,mlflow")


def test_a_missing_package_is_refused_naming_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    trackers.check("tensorboard,csv")  # these are there
    with pytest.raises(ConfigError, match=r"tracker: wandb needs the wandb package, which is not installed"):
        trackers.check("tensorboard,wandb")


@pytest.mark.parametrize("env, message", [
    ({"WANDB_MODE": "sometimes"}, "WANDB_MODE must be one of offline, online"),
    ({"WANDB_MODE": "online"}, "WANDB_MODE=online needs a W&B login"),
])
def test_wandb_settings_that_cannot_start_are_refused(monkeypatch, tmp_path, env, message):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no login anywhere
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=message):
        trackers.check("wandb")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    if env["WANDB_MODE"] == "online":  # with a login it would start
        trackers.check("wandb")


def test_online_wandb_without_a_login_is_one_line_before_anything_is_recorded(monkeypatch, tmp_path):
    from conftest import in_process
    from training.cli import parse_args
    from training.run import main

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_MODE", "online")
    runs = tmp_path / "runs"
    proc = in_process(lambda a: main(parse_args(a)), ["--preset", "tiny", "--device", "cpu", "--steps", "2",
                                                      "--runs_dir", str(runs), "--tracker", "wandb"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("train.py: error: tracker: wandb with WANDB_MODE=online needs a W&B login"), lines
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not list(runs.rglob("summary.json"))


def test_the_configuration_is_flattened_into_plain_hyperparameters():
    flat = trackers.flat({"run": {"backend": "ddp", "steps": 4, "tracker": None}, "plan": [1, 2],
                          "environment": {"device": "cpu", "world": {"size": 2}}})
    assert flat == {"run.backend": "ddp", "run.steps": 4, "plan": "[1, 2]", "environment.device": "cpu",
                    "environment.world.size": 2}


# ------------------------------------------------- a sweep with every tracker, read back per record

def wandb_records(path: Path) -> list:
    """The records of a W&B offline run file (run-<id>.wandb), decoded with wandb's own protobuf
    schema. wandb 0.31 writes them from its Go core and ships no Python reader; the file is LevelDB's
    log format (32 KiB blocks of CRC32, length, type and payload) after a 7-byte `:W&B` header."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """sweep.py --tracker tensorboard --tracker wandb --tracker csv on two runs (one process; DDP on 2
    ranks), forked like the suite's other sweeps: the directory of their records."""
    from launches import sweep_forked

    root = tmp_path_factory.mktemp("tracked")
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "tracked", "steps": STEPS, "runs_dir": str(root / "runs"),
        "matrix": {"backend": ["single", "ddp"], "preset": ["tiny"], "world_size": [2], "micro_batch": [4]},
        "train_args": {"warmup_steps": 1, "eval_every": 2, "eval_batches": 1, "mem_profile_steps": 0,
                       "tracker": "tensorboard"}}))
    proc = sweep_forked(spec, {"WANDB_MODE": "offline"}, "--tracker", "wandb", "--tracker", "csv")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "runs"


def _records(runs: Path) -> list[Path]:
    records = sorted(p.parent for p in runs.glob("*/summary.json"))
    assert [r.name.split("-")[0] for r in records] == ["ddp", "single"], records
    return records


def _expected(record: Path) -> dict[str, dict[int, float]]:
    """Per tracker name, step -> value, from the record's metrics.jsonl."""
    want: dict[str, dict[int, float]] = {}
    for line in read_jsonl(record / "metrics.jsonl"):
        for key, name in trackers.STEP_SCALARS.items():
            value = line.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                want.setdefault(name, {})[line["step"]] = float(value)
    assert len(want["train/loss"]) == STEPS and len(want["train/val_loss"]) == 3  # steps 1, 3 and the last
    return want


@pytest.mark.distributed
def test_tensorboard_event_files_hold_the_records_scalars(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for record in _records(tracked):
        assert json.loads((record / "summary.json").read_text())["status"] == "ok"
        events = EventAccumulator(str(record), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        want = _expected(record)
        for name, by_step in want.items():
            got = {e.step: e.value for e in events.Scalars(name)}
            assert got.keys() == by_step.keys(), (record.name, name)
            for step, value in by_step.items():  # event files hold float32
                assert got[step] == pytest.approx(value, rel=1e-6), (record.name, name, step)
        summary = json.loads((record / "summary.json").read_text())
        final = {e.step: e.value for e in events.Scalars("summary/samples_per_s")}
        assert final == {STEPS - 1: pytest.approx(summary["samples_per_s"], rel=1e-6)}
        # The resolved configuration as the HParams tab's hyperparameters.
        assert set(events.PluginTagToContent("hparams")) >= {"_hparams_/experiment", "_hparams_/session_start_info"}
        config = json.loads((record / "config.json").read_text())
        text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
        assert json.loads(text.strip("`\n"))["run"]["backend"] == config["run"]["backend"]


@pytest.mark.distributed
def test_a_wandb_offline_run_is_written_per_record_and_reads_back(tracked):
    for record in _records(tracked):
        files = list(record.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(files) == 1, files
        records = wandb_records(files[0])
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert run.display_name == record.name
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["run.backend"] == json.loads((record / "config.json").read_text())["run"]["backend"]
        history: dict[str, dict[int, float]] = {}
        for r in records:
            if r.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                for name, value in items.items():
                    if not name.startswith("_"):
                        history.setdefault(name, {})[items["_step"]] = float(value)
        assert history.keys() == _expected(record).keys()
        for name, by_step in _expected(record).items():
            assert history[name] == pytest.approx(by_step, rel=1e-12), (record.name, name)
        summary = {}
        for r in records:
            if r.WhichOneof("record_type") == "summary":
                summary.update({item.key: json.loads(item.value_json) for item in r.summary.update if item.key})
        assert summary["status"] == "ok"


@pytest.mark.distributed
def test_csv_rows_are_the_records_lines_and_the_report_says_where_each_tracker_is(tracked, tmp_path, capsys):
    for record in _records(tracked):
        with open(record / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        lines = read_jsonl(record / "metrics.jsonl")
        assert [int(r["step"]) for r in rows] == [line["step"] for line in lines]
        assert [float(r["loss"]) for r in rows] == [line["loss"] for line in lines]
    from analysis.report import main

    assert main([str(tracked), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Trackers" in text and f"tensorboard --logdir {tracked}" in text
    for record in _records(tracked):
        assert f"wandb sync {next(record.glob('wandb/offline-run-*'))}" in text
        assert str(record / "metrics.csv") in text
