"""Exclusive file locks (flock) that name their holder: one writer per record, per checkpoint
directory, per NVMe swap folder. No torch here: the sweep runner and a Slurm job's wrapper take them
before any run starts."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from gptlite.errors import ConfigError


class LockHeld(ConfigError):
    """Another process holds the lock; `holder` says which ("pid 1234")."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


class FileLock:
    """An exclusive lock (flock) on `path`, with the holder's pid written in it, held until
    release() or the process exits (the kernel releases it with the process, however it ends).
    Raises LockHeld naming the holder when another process has it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise LockHeld(f"{self.path} is held by {holder}", holder) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()}\n")
        self.file.flush()

    def release(self) -> None:
        self.file.close()  # closing the file drops the lock


class RecordLock(FileLock):
    """One writer per record: an exclusive lock on runs_dir/.locks/<run_name>, held until exit."""

    def __init__(self, runs_dir: str, run_name: str):
        try:
            super().__init__(Path(runs_dir) / ".locks" / f"{run_name}.lock")
        except LockHeld as e:
            raise LockHeld(f"run_name: {Path(runs_dir) / run_name} is being written by {e.holder}; wait for it "
                           "to finish, or choose another --run_name", e.holder) from None
