"""Launch planned runs one at a time, each through its real launcher, and settle their records.

One sweep at a time writes into a directory (`hold_directory`: <dir>/.sweep.lock, naming its
holder). A run's record is reused ("already done") only when it was made by the same run: each run
is given its key (SweepRun.key: flags, launcher, environment, the config file's contents) and
writes it into its record (core/records.py SWEEP_KEY_FILE) as it creates it, holding the record's
lock, so key and record have one writer. A record whose key differs is refused before anything
starts, never silently taken for the new run nor overwritten, unless its run never got going
(refused, or failed before it wrote its config): such a record holds nothing but the reason, and
a corrected spec replaces it. A finished record is never rewritten; a failed or timed-out one only
with --retry_failed; an unfinished one (a sweep stopped mid-run) is run again. The runner replaces
a record itself, holding the record's lock, and never passes --overwrite; a record another process
holds is left alone. Stopping the sweep (Ctrl-C, SIGTERM) stops the run in progress with it: its
launcher and every rank, and its record says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from core.records import SWEEP_KEY_ENV, SWEEP_KEY_FILE, atomic_write_json, read_json, read_summary
from core.summary import FINISHED, RunSummary
from gptlite.errors import ConfigError
from orchestration.launch import REPO, launch_env
from training.locks import FileLock, LockHeld, RecordLock
from training.progress import runs_bar
from orchestration.sweep import SweepRun

RETRYABLE = ("failed", "timeout")
# Run again whenever the spec is: a cancelled run was stopped by its user, not by its result.
RERUN = ("cancelled",)
# What a rank stopped by a signal records (training/run.py Terminated): when the runner or the
# scheduler stopped it on purpose, the record says why instead.
TERMINATED = "terminated by signal"
# How long the runner waits, after a launcher exits, for its ranks to let go of the record's lock.
SETTLE_WAIT_S = 60.0


class Stopped(Exception):
    """The sweep itself was asked to stop (SIGTERM)."""


@dataclass
class Outcome:
    run: SweepRun
    summary: RunSummary
    seconds: float
    skipped: bool = False
    left_alone: str | None = None  # why the record was not touched: another process writes it

    @property
    def status(self) -> str:
        return "left alone" if self.left_alone else self.summary.status

    def line(self) -> str:
        s = self.summary
        if self.left_alone:
            return f"{self.run.name}: left alone ({self.left_alone})"
        if self.skipped:
            return f"{self.run.name}: {self.status} (already done)"
        if self.status != "ok":
            return f"{self.run.name}: {self.status} after {self.seconds:.0f} s | {s.error or ''}"
        rate = f"{s.samples_per_s:.1f} samples/s" if s.samples_per_s else "not timed"
        peak = f"peak {s.mem_peak_bytes / 2**20:.1f} MiB" if s.mem_peak_bytes else "peak n/a"
        return f"{self.run.name}: ok | {rate} | {peak} | loss {s.final_loss or 0:.4f} | {self.seconds:.0f} s"


class Runner:
    """Launches planned runs one at a time into `directory`."""

    def __init__(self, directory: Path, timeout_s: float, retry_failed: bool = False, child_ignores: tuple = ()):
        self.directory = Path(directory)
        self.timeout_s = timeout_s
        self.retry_failed = retry_failed
        # Signals the launched run ignores (it and its ranks inherit that): a Slurm job's SIGUSR2
        # ahead of its time limit reaches every process of the job, and its default action would
        # kill the run before the runner stops it in order (orchestration/slurm.py).
        self.child_ignores = tuple(child_ignores)
        self.directory_lock: FileLock | None = None
        self._current: tuple | None = None  # (planned, launcher process, log, start) of the run in progress

    def hold_directory(self) -> FileLock:
        """This directory for this sweep alone, until it exits (ConfigError naming the holder): its lock."""
        try:
            self.directory_lock = FileLock(self.directory / ".sweep.lock")
        except LockHeld as e:
            raise ConfigError(f"{self.directory} is in use by another sweep ({e.holder}); one sweep per directory "
                              "at a time: wait for it to finish, or give this one another name or runs_dir") from None
        return self.directory_lock

    def done(self, planned: SweepRun) -> RunSummary | None:
        """The record of `planned` when it needs no launch: finished by these settings (its key),
        not cancelled, and not a failure that --retry_failed asks to run again."""
        summary = read_summary(self.directory / planned.name / "summary.json")
        if (summary is not None and summary.status in FINISHED and summary.status not in RERUN
                and stored_key(self.directory, planned) == planned.key()
                and not (self.retry_failed and summary.status in RETRYABLE)):
            return summary
        return None

    def check_records(self, runs: list[SweepRun]) -> None:
        """Refuse (ConfigError) when a run's name holds a record made with other settings."""
        for planned in runs:
            changed = other_settings(self.directory, planned)
            if changed is not None:
                raise ConfigError(f"{self.directory / planned.name} was recorded with other settings ({changed}); "
                                  "give the sweep another name (or runs_dir), or move the old records away")

    def run(self, planned: SweepRun, command: list[str] | None = None) -> Outcome:
        """Launch `planned` (its own command, or `command`: the same run started otherwise, as a
        Slurm job's node does) and settle its record."""
        record = self.directory / planned.name
        try:
            lock = RecordLock(str(self.directory), planned.name)
        except LockHeld as e:  # another process writes this record now: never touch it
            return _left_alone(planned, 0.0, f"being written by {e.holder}")
        try:  # decided holding the record's lock, so nothing else can write it meanwhile
            self.check_records([planned])
            existing = self.done(planned)
            if existing is not None:
                return Outcome(planned, existing, 0.0, True)
            # This run's unfinished or failed attempt, or a run that never got going, starts over;
            # a run with checkpoints (save_every) continues from its last one into its record.
            continuing = planned.resumable and (record / "config.json").exists()
            if record.exists() and not continuing:
                shutil.rmtree(record)
        finally:
            lock.release()
        log_dir = self.directory / ".logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{planned.name}.log"
        started = time.monotonic()
        env = {**launch_env(dict(planned.env)), SWEEP_KEY_ENV: json.dumps(planned.key())}
        ignores = self.child_ignores
        with open(log, "a" if continuing else "w") as out:  # a continued run's log goes on
            proc = subprocess.Popen(command or planned.command(self.directory), cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=(lambda: [signal.signal(s, signal.SIG_IGN) for s in ignores])
                                    if ignores else None)
            self._current = (planned, proc, log, started)
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
            finally:
                self._current = None
        seconds = time.monotonic() - started
        return self._settle(planned, proc.returncode, timed_out, log, seconds)

    def stop_current(self, status: str, why: str) -> Outcome | None:
        """Stop the run in progress (its launcher and every rank) and record it as `status` with
        `why`, unless it finished first: a Slurm job about to be stopped at its time limit or
        preempted (orchestration/slurm.py) settles its run this way before the scheduler kills it."""
        if self._current is None:
            return None
        planned, proc, log, started = self._current
        _kill_group(proc)
        return self._settle(planned, proc.returncode, False, log, time.monotonic() - started, ended=(status, why))

    def settle_ended(self, planned: SweepRun, status: str, why: str) -> Outcome:
        """Record `planned` as `status` with `why` when its launch ended elsewhere without settling it
        (a Slurm job killed at its time limit, cancelled while queued, or its node lost); a record
        the run settled itself is left as it is."""
        return self._settle(planned, 0, False, self.directory / ".logs" / f"{planned.name}.log", 0.0,
                            ended=(status, why))

    def _settle(self, planned: SweepRun, returncode: int | None, timed_out: bool, log: Path, seconds: float,
                interrupted: str | None = None, ended: tuple[str, str] | None = None) -> Outcome:
        """The run's outcome, its final summary written here when the run could not write one
        itself: only into the run's own record (its key), or a new one, holding the record's lock."""
        record = self.directory / planned.name
        lock = wait_for(lambda: RecordLock(str(self.directory), planned.name), SETTLE_WAIT_S)
        if isinstance(lock, LockHeld):  # a rank still alive, or another process took the record
            return _left_alone(planned, seconds, f"still held by {lock.holder} {SETTLE_WAIT_S:g} s after the run")
        try:
            if record.exists() and _read_key(record) != planned.key():  # not this run's
                return _left_alone(planned, seconds, "another process wrote it while this run started")
            path = record / "summary.json"
            summary = read_summary(path) or RunSummary(run_name=planned.name, backend=planned.backend,
                                                       world_size=planned.world_size, wall_time_s=seconds)
            if ended and (summary.status == "running"
                          or summary.status == "failed" and TERMINATED in (summary.error or "")):
                summary = summary.ended(*ended, summary.wall_time_s or seconds)
            elif interrupted and summary.status in ("running", "ok") and returncode != 0:
                summary = summary.ended("failed", interrupted, summary.wall_time_s or seconds)
            elif timed_out:
                summary = summary.ended("timeout", f"timed out after {self.timeout_s:g} s (sweep timeout_s)",
                                        summary.wall_time_s or seconds)
            elif summary.status == "running":
                summary = summary.ended("failed", f"exit code {returncode}: {_last_line(log)}",
                                        summary.wall_time_s or seconds)
            elif summary.status == "ok" and returncode != 0:
                summary = summary.ended("failed", f"exit code {returncode} after the record was written: "
                                                  f"{_last_line(log)}")
            else:
                return Outcome(planned, summary, seconds)
            try:
                if not record.exists():  # the run stopped before creating its record: one saying why, with its key
                    atomic_write_json(record / SWEEP_KEY_FILE, planned.key())
                atomic_write_json(path, summary.to_dict())
            except OSError as e:  # its folder cannot be written: said here; --status and the report show it dead
                summary = summary.ended(summary.status, f"{summary.error} (not recorded: {type(e).__name__}: "
                                                        f"{e.strerror or e})")
            return Outcome(planned, summary, seconds)
        finally:
            lock.release()


def _left_alone(planned: SweepRun, seconds: float, why: str) -> Outcome:
    return Outcome(planned, RunSummary(planned.name), seconds, left_alone=why)


def _read_key(record: Path) -> dict | None:
    try:
        return read_json(record / SWEEP_KEY_FILE)
    except (OSError, ValueError):
        return None


def stored_key(directory: Path, planned: SweepRun) -> dict | None:
    """The sweep key in the run's record; records of sweeps before keys moved into them have theirs
    in <dir>/.keys/."""
    for path in (directory / planned.name / SWEEP_KEY_FILE, directory / ".keys" / f"{planned.name}.json"):
        try:
            return read_json(path)
        except (OSError, ValueError):
            continue
    return None


def other_settings(directory: Path, planned: SweepRun) -> str | None:
    """How the record under `planned`'s name differs from `planned` (its key), where one exists that was
    made with other settings; None where there is none or it is this run's. Running refuses such a
    record (Runner.check_records) and --status does not report it as this run's (orchestration/slurm.py)."""
    record = directory / planned.name
    if not record.exists() or _never_got_going(record):
        return None
    stored = stored_key(directory, planned)
    return None if stored == planned.key() else _first_difference(stored, planned.key())


def _never_got_going(record: Path) -> bool:
    """A record of a run refused or failed before it wrote its config: it holds nothing but why,
    so a corrected spec may replace it, whatever settings it had."""
    summary = read_summary(record / "summary.json")
    return summary is not None and summary.status in RETRYABLE + RERUN and not (record / "config.json").exists()


def wait_for(take, timeout_s: float):
    """take() (a lock), retried until it is free or `timeout_s` passed; then the last LockHeld."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return take()
        except LockHeld as e:
            if time.monotonic() >= deadline:
                return e
            time.sleep(0.5)


def stop_on_sigterm() -> None:
    """SIGTERM to the sweep raises Stopped, so the run in progress is stopped and settled."""
    def handler(signum, frame):
        raise Stopped(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a launcher and its ranks: SIGTERM to its process group (the launchers pass it on, and
    ranks die with their launcher), then SIGKILL after a grace period. SIGCONT follows SIGTERM, as
    Slurm sends them: a stopped process (Ctrl-Z, a debugger) handles SIGTERM only once continued."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGCONT)
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


class LocalSweep:
    """The local executor: a sweep's runs one after another on this machine, through the Runner.
    orchestration/slurm.SlurmSweep is the other; both are built by orchestration/executors.executor_for and
    called alike (hold_directory, check, run_all)."""

    def __init__(self, name: str, directory: Path, timeout_s: float, runs, retry_failed: bool = False):
        self.name, self.runs = name, list(runs)
        self.directory = Path(directory)
        self.runner = Runner(self.directory, timeout_s, retry_failed=retry_failed)

    def hold_directory(self) -> FileLock:
        """The directory for this sweep alone until it exits (ConfigError naming the holder)."""
        return self.runner.hold_directory()

    def check(self) -> None:
        """Refuse (ConfigError) a run whose name holds a record made with other settings."""
        self.runner.check_records(self.runs)

    def run_all(self, report, follow: bool = True) -> list[Outcome]:
        """Each run in turn, a line through `report` as it starts and one as it ends (a progress bar
        on a terminal); every run's Outcome, in order (a run recorded before by the same settings
        as already done). `follow`: always, here."""
        def say(line: str) -> None:
            with tqdm.external_write_mode():
                report(line)

        outcomes = []
        total = len(self.runs)
        with runs_bar(total, self.name) as bar:
            for i, run in enumerate(self.runs, 1):
                bar.set_postfix_str(run.name, refresh=True)
                say(f"[{i}/{total}] {run.name} ...")
                outcomes.append(self.runner.run(run))
                say(f"[{i}/{total}] {outcomes[-1].line()}")
                bar.update()
        return outcomes


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
