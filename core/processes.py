"""A process on this machine, from the kernel (/proc): where a pid means the same process, when a process
started, whether it still runs. Without torch: the sweep runner reads records' heartbeats
(core/records.py) with it, and the ranks watch each other with it (core/peers.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def machine_id() -> str | None:
    """This kernel and pid namespace (boot id and the namespace's inode): where a pid means the same
    process. None where there is no /proc (not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the third (state) on; None where the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """When the process started (clock ticks since boot): with its pid, a process that no later one
    with the same pid is taken for."""
    fields = stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def alive(pid: int, started: str | None) -> bool:
    """Whether process `pid`, started at `started` (start_time), still runs on this machine (a zombie
    has ended)."""
    fields = stat_fields(pid)
    if fields is None:
        return False
    return fields[0] not in ("Z", "X") and (started is None or fields[19] == started)
