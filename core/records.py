"""Run records: `runs/<run_name>/{config.json, metrics.jsonl, summary.json}`.

Every file is replaced atomically (written to a temporary file in the same directory, flushed,
then renamed over the old one), so a run killed at any moment leaves each file either as it was or
complete, never truncated. metrics.jsonl is rewritten whole at most every `flush_interval_s`
seconds and at the end; a killed run loses at most that many seconds of metric lines.

A rank that fails writes `errors/rank<k>.json`; the summary of a failed run names the first
rank's error as the cause (the other ranks usually fail after it, on a broken connection).
runs/README.md documents every field; bump SCHEMA_VERSION when a field changes meaning.

While it runs, rank 0 keeps `heartbeat.json` beside the summary (its pid, host and the time, every
HEARTBEAT_EVERY_S seconds, from a thread: nothing per step). A run that could not record its end
(its folder became unwritable, or it was killed) leaves `status: running` for ever; `dead_because`
tells such a record from a live one by that file, so that sweep.py --status and the report show
it dead without rewriting it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

from core.processes import alive, machine_id, start_time
from core.summary import SCHEMA_VERSION, RunSummary

# A sweep passes each run its key (orchestration/sweep.py SweepRun.key) in this variable; the run's
# rank 0 writes it into its record as SWEEP_KEY_FILE right after creating the record, holding the
# record's lock: key and record have one writer, so they never disagree (orchestration/runner.py).
SWEEP_KEY_ENV = "GPTLITE_SWEEP_KEY"
SWEEP_KEY_FILE = "sweep_key.json"
HEARTBEAT_FILE = "heartbeat.json"
HEARTBEAT_EVERY_S = 30.0
# A heartbeat from another machine this old is a dead run's (its pid cannot be checked from here):
# twenty missed beats, room for clocks that disagree by minutes.
STALE_AFTER_S = 600.0


class RecordNotWritable(Exception):
    """A record's folder can no longer be written (made read-only, its disk full, its mount gone)."""

    def __init__(self, directory: Path, error: OSError):
        where = f": {error.filename}" if error.filename else ""
        super().__init__(f"record {directory} cannot be written ({type(error).__name__}: "
                         f"{error.strerror or error}{where})")


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

    def _write(self, path: Path, text: str) -> None:
        try:
            atomic_write_text(path, text)
        except OSError as e:
            raise RecordNotWritable(self.dir, e) from e

    def _write_json(self, path: Path, obj) -> None:
        self._write(path, json.dumps(_clean(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")

    def write_config(self, config: dict) -> None:
        self._write_json(self.config_path, {"schema_version": SCHEMA_VERSION, **config})

    def log(self, metrics: dict) -> None:
        self._metrics.append(metrics)
        self._metrics_text.append(json.dumps(_clean(metrics), allow_nan=False))
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        self._write(self.metrics_path, "".join(line + "\n" for line in self._metrics_text))
        self._last_flush = time.monotonic()

    @property
    def metrics(self) -> list[dict]:
        return self._metrics

    def write_summary(self, summary: RunSummary) -> None:
        self._write_json(self.summary_path, summary.to_dict())

    def read_summary(self) -> RunSummary | None:
        return read_summary(self.summary_path)

    def write_rank_error(self, rank: int, status: str, error: str, at: float | None = None) -> None:
        """Rank `rank`'s error, at `at` (default now): by the rank itself, or by another one that saw
        it die (core/peers.py)."""
        self._write_json(self.errors_dir / f"rank{rank}.json",
                         {"rank": rank, "status": status, "error": error, "time": time.time() if at is None else at})

    def rank_errors(self) -> list[dict]:
        """Errors that ranks wrote, earliest first."""
        if not self.errors_dir.is_dir():
            return []
        errors = [read_json(p) for p in self.errors_dir.glob("rank*.json")]
        return sorted(errors, key=lambda e: e["time"])


class Heartbeat:
    """Rank 0's sign of life in its record: heartbeat.json (pid, host, machine, the process's start
    and the time), written now (raising RecordNotWritable, as any record write) and then every
    `every_s` seconds by a thread until `stop`. A beat that fails is left to the run's next write
    to report."""

    def __init__(self, record_dir: Path, every_s: float = HEARTBEAT_EVERY_S):
        self.path = Path(record_dir) / HEARTBEAT_FILE
        self.every_s = every_s
        self._fields = {"pid": os.getpid(), "host": socket.gethostname(), "machine": machine_id(),
                        "process_start": start_time(os.getpid()), "every_s": every_s}
        try:
            self.beat()
        except OSError as e:
            raise RecordNotWritable(self.path.parent, e) from e
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gptlite-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        atomic_write_json(self.path, {**self._fields, "time": time.time()})

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.beat()
            except OSError:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def dead_because(record_dir: Path, now: float | None = None) -> str | None:
    """Why the run of a record whose summary says `running` is not running any more, from its
    heartbeat.json: its process is gone (on this machine: its pid, checked with its start time), or
    its last beat is older than STALE_AFTER_S (another machine). None where it may still run, or
    where the record has no heartbeat (written before records had one)."""
    try:
        beat = read_json(Path(record_dir) / HEARTBEAT_FILE)
        pid, host, last = int(beat["pid"]), str(beat["host"]), float(beat["time"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    here = machine_id()
    if here is not None and beat.get("machine") == here:
        if alive(pid, beat.get("process_start")):
            return None
        return f"its process (pid {pid} on {host}) is gone"
    age = (time.time() if now is None else now) - last
    if age > STALE_AFTER_S:
        return f"no heartbeat from its process (pid {pid} on {host}) for {_duration(age)}"
    return None


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def read_summary(path: Path) -> RunSummary | None:
    """The summary in `path`, or None when there is none or it is not a summary."""
    try:
        return RunSummary.from_dict(read_json(path))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
