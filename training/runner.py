"""Launch planned runs one at a time, each through its real launcher, and settle their records.

A run's record is reused ("already done") only when it was made by the same run: the runner keeps
each run's key (PlannedRun.key: flags, launcher, environment, the config file's contents) in
<sweep dir>/.keys/<run>.json, and a record whose key differs is refused before anything starts,
never silently taken for the new run nor overwritten. A finished record is never rewritten; a
failed or timed-out one only with --retry_failed; an unfinished one (a sweep stopped mid-run) is
run again. Stopping the sweep (Ctrl-C, SIGTERM) stops the run in progress with it: its launcher and
every rank, and its record says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from core.records import atomic_write_json, read_json, read_summary
from core.summary import FINISHED, RunSummary
from gptlite.errors import ConfigError
from training.launch import REPO, launch_env
from training.sweep import PlannedRun

RETRYABLE = ("failed", "timeout")


class Stopped(Exception):
    """The sweep itself was asked to stop (SIGTERM)."""


@dataclass
class Outcome:
    run: PlannedRun
    summary: RunSummary
    seconds: float
    skipped: bool = False

    @property
    def status(self) -> str:
        return self.summary.status

    def line(self) -> str:
        s = self.summary
        if self.skipped:
            return f"{self.run.name}: {self.status} (already done)"
        if self.status != "ok":
            return f"{self.run.name}: {self.status} after {self.seconds:.0f} s | {s.error or ''}"
        rate = f"{s.samples_per_s:.1f} samples/s" if s.samples_per_s else "not timed"
        peak = f"peak {s.mem_peak_bytes / 2**20:.1f} MiB" if s.mem_peak_bytes else "peak n/a"
        return f"{self.run.name}: ok | {rate} | {peak} | loss {s.final_loss or 0:.4f} | {self.seconds:.0f} s"


class Runner:
    """Launches planned runs one at a time into `directory`."""

    def __init__(self, directory: Path, timeout_s: float, retry_failed: bool = False):
        self.directory = Path(directory)
        self.timeout_s = timeout_s
        self.retry_failed = retry_failed

    def _key_path(self, planned: PlannedRun) -> Path:
        return self.directory / ".keys" / f"{planned.name}.json"

    def check_records(self, runs: list[PlannedRun]) -> None:
        """Refuse (ConfigError) when a run's name holds a record made with other settings."""
        for planned in runs:
            if not (self.directory / planned.name).exists():
                continue
            try:
                stored = read_json(self._key_path(planned))
            except (OSError, ValueError):
                stored = None
            if stored != planned.key():
                changed = _first_difference(stored, planned.key())
                raise ConfigError(f"{self.directory / planned.name} was recorded with other settings ({changed}); "
                                  "give the sweep another name (or runs_dir), or move the old records away")

    def run(self, planned: PlannedRun) -> Outcome:
        self.check_records([planned])
        record = self.directory / planned.name
        existing = read_summary(record / "summary.json")
        if existing is not None and existing.status in FINISHED and not (
                self.retry_failed and existing.status in RETRYABLE):
            return Outcome(planned, existing, 0.0, True)
        atomic_write_json(self._key_path(planned), planned.key())
        log_dir = self.directory / ".logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{planned.name}.log"
        started = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(planned.command(self.directory, overwrite=record.exists()), cwd=REPO,
                                    env=launch_env(dict(planned.env)), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
            except BaseException as stop:  # Ctrl-C or SIGTERM to the sweep: the run stops with it
                _kill_group(proc)
                self._settle(planned, proc.returncode, False, log, time.monotonic() - started,
                             interrupted=f"the sweep was stopped ({type(stop).__name__})")
                raise
        seconds = time.monotonic() - started
        return Outcome(planned, self._settle(planned, proc.returncode, timed_out, log, seconds), seconds)

    def _settle(self, planned: PlannedRun, returncode: int | None, timed_out: bool, log: Path, seconds: float,
                interrupted: str | None = None) -> RunSummary:
        """The run's final summary; written here when the run could not write one itself."""
        path = self.directory / planned.name / "summary.json"
        summary = read_summary(path) or RunSummary(run_name=planned.name, backend=planned.backend,
                                                   world_size=planned.world_size, wall_time_s=seconds)
        if interrupted and summary.status in ("running", "ok") and returncode != 0:
            summary = summary.ended("failed", interrupted, summary.wall_time_s or seconds)
        elif timed_out:
            summary = summary.ended("timeout", f"timed out after {self.timeout_s:g} s (sweep timeout_s)",
                                    summary.wall_time_s or seconds)
        elif summary.status == "running":
            summary = summary.ended("failed", f"exit code {returncode}: {_last_line(log)}", summary.wall_time_s or seconds)
        elif summary.status == "ok" and returncode != 0:
            summary = summary.ended("failed", f"exit code {returncode} after the record was written: "
                                              f"{_last_line(log)}")
        else:
            return summary
        atomic_write_json(path, summary.to_dict())
        return summary


def stop_on_sigterm() -> None:
    """SIGTERM to the sweep raises Stopped, so the run in progress is stopped and settled."""
    def handler(signum, frame):
        raise Stopped(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a launcher and its ranks: SIGTERM to its process group (the launchers pass it on, and
    ranks die with their launcher), then SIGKILL after a grace period."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][:500]


def _first_difference(stored: dict | None, current: dict) -> str:
    if stored is None:
        return "no key was kept for it"
    for name in current:
        if stored.get(name) != current[name]:
            if name == "flags":
                before, now = _flag_dict(stored.get(name) or []), _flag_dict(current[name])
                diff = [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
                if diff:
                    return f"{diff[0]} {before.get(diff[0])!r} then, {now.get(diff[0])!r} now"
            return f"{name} changed"
    return "changed"


def _flag_dict(flags: list[str]) -> dict[str, str | bool]:
    out, i = {}, 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[flags[i]] = flags[i + 1]
            i += 2
        else:
            out[flags[i]] = True
            i += 1
    return out
