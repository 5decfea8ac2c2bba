"""Run records: `runs/<run_name>/{config.json, metrics.jsonl, summary.json}`.

Every file is replaced atomically (written to a temporary file in the same directory, flushed,
then renamed over the old one), so a run killed at any moment leaves each file either as it was or
complete, never truncated. metrics.jsonl is rewritten whole at most every `flush_interval_s`
seconds and at the end; a killed run loses at most that many seconds of metric lines.

A rank that fails writes `errors/rank<k>.json`; the summary of a failed run names the first
rank's error as the cause (the other ranks usually fail after it, on a broken connection).
runs/README.md documents every field; bump SCHEMA_VERSION when a field changes meaning.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from core.summary import SCHEMA_VERSION, RunSummary

# A sweep passes each run its key (training/sweep.py PlannedRun.key) in this variable; the run's
# rank 0 writes it into its record as SWEEP_KEY_FILE right after creating the record, holding the
# record's lock: key and record have one writer, so they never disagree (training/runner.py).
SWEEP_KEY_ENV = "GPTLITE_SWEEP_KEY"
SWEEP_KEY_FILE = "sweep_key.json"


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; records are meant to be shared and read
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _clean(obj):
    """JSON has no NaN or infinity: write them as null, so every record is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(_clean(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def read_jsonl(path: Path) -> list[dict]:
    text = Path(path).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class RunRecord:
    """The record directory of one run. Only rank 0 writes config, metrics and summary."""

    def __init__(self, run_dir: Path, flush_interval_s: float | None = None):
        self.dir = Path(run_dir)
        if flush_interval_s is None:
            flush_interval_s = float(os.environ.get("GPTLITE_METRICS_FLUSH_S", 2.0))
        self.flush_interval_s = flush_interval_s
        self._metrics: list[dict] = []
        self._metrics_text: list[str] = []
        self._last_flush = 0.0

    @property
    def config_path(self) -> Path:
        return self.dir / "config.json"

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.dir / "summary.json"

    @property
    def errors_dir(self) -> Path:
        return self.dir / "errors"

    def create(self, overwrite: bool) -> None:
        if self.dir.exists():
            if not overwrite:
                raise FileExistsError(
                    f"run_name: {self.dir} already exists (choose another --run_name or pass --overwrite)")
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)

    def continue_after(self, step: int) -> None:
        """Reuse this run's directory for a resumed run: keep the metric lines up to `step`."""
        if self.metrics_path.exists():
            for line in read_jsonl(self.metrics_path):
                if line["step"] <= step:
                    self._metrics.append(line)
                    self._metrics_text.append(json.dumps(_clean(line), allow_nan=False))
        self.flush()

    def write_config(self, config: dict) -> None:
        atomic_write_json(self.config_path, {"schema_version": SCHEMA_VERSION, **config})

    def log(self, metrics: dict) -> None:
        self._metrics.append(metrics)
        self._metrics_text.append(json.dumps(_clean(metrics), allow_nan=False))
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        atomic_write_text(self.metrics_path, "".join(line + "\n" for line in self._metrics_text))
        self._last_flush = time.monotonic()

    @property
    def metrics(self) -> list[dict]:
        return self._metrics

    def write_summary(self, summary: RunSummary) -> None:
        atomic_write_json(self.summary_path, summary.to_dict())

    def read_summary(self) -> RunSummary | None:
        return read_summary(self.summary_path)

    def write_rank_error(self, rank: int, status: str, error: str) -> None:
        atomic_write_json(self.errors_dir / f"rank{rank}.json",
                          {"rank": rank, "status": status, "error": error, "time": time.time()})

    def rank_errors(self) -> list[dict]:
        """Errors that ranks wrote, earliest first."""
        if not self.errors_dir.is_dir():
            return []
        errors = [read_json(p) for p in self.errors_dir.glob("rank*.json")]
        return sorted(errors, key=lambda e: e["time"])


def read_summary(path: Path) -> RunSummary | None:
    """The summary in `path`, or None when there is none or it is not a summary."""
    try:
        return RunSummary.from_dict(read_json(path))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
