"""How the other ranks on this machine ended, from the kernel: which rank died, and of what.

A rank killed outright (SIGKILL from a user, a scheduler or the kernel's out-of-memory killer; a
segfault in a library) records nothing, and the ranks that survive it fail a moment later on a
broken connection ("Connection reset by peer"): taken for the cause, they would hide it. The
launcher knows better (torchrun's ChildFailedError, the deepspeed launcher's "exits with return
code = -9"), but only in its own output, after every rank has written the record, and it has no
hook to tell them. So each rank watches the others on its machine (`Peers.watch`, once the
process group exists): their pids, exchanged once, each held as a pidfd (Linux 5.3 and later),
a thread waiting on them. When one ends, its exit status is read at once: from the pidfd
(PIDFD_GET_INFO, Linux 6.15 and later, even after the launcher reaped it) or else from
/proc/<pid>/stat while it is still a zombie (torchrun reaps every 0.1 s, the deepspeed launcher
every second). A rank that fails asks `Peers.ended()` and records the dead rank as the cause
(training/run.py). Ranks on other machines are not seen here: the survivors on their machine say.
Nothing runs during a step: the thread sleeps in poll() until a rank ends.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from core.dist import is_fake_process_group
from core.processes import machine_id, start_time, stat_fields

# <linux/pidfd.h>: struct pidfd_info's first 64 bytes (PIDFD_INFO_SIZE_VER0), exit_code at offset 60.
PIDFD_INFO_EXIT = 1 << 3
PIDFD_GET_INFO = (3 << 30) | (64 << 16) | (0xFF << 8) | 11  # _IOWR(PIDFS_IOCTL_MAGIC, 11, 64 bytes)
EXIT_CODE_OFFSET = 60


def _exit_status(pidfd: int, pid: int) -> int | None:
    """The wait status of the ended process behind `pidfd`; None where the kernel no longer says."""
    info = bytearray(64)
    struct.pack_into("=Q", info, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, info, True)
        if struct.unpack_from("=Q", info, 0)[0] & PIDFD_INFO_EXIT:
            return struct.unpack_from("=i", info, EXIT_CODE_OFFSET)[0]
    except OSError:  # before Linux 6.15
        pass
    fields = stat_fields(pid)  # a zombie until its launcher reaps it: field 52, exit_code
    if fields and fields[0] == "Z" and len(fields) > 49:
        return int(fields[49])
    return None


@dataclass(frozen=True)
class Ended:
    """A rank of this machine whose process ended: its wait status (None: not seen) and when."""

    rank: int
    pid: int
    status: int | None
    time: float

    @property
    def killed(self) -> bool:
        return self.status is not None and os.WIFSIGNALED(self.status)

    def describe(self) -> str | None:
        """How it ended, for the record ("killed by SIGKILL"); None for a clean exit."""
        if self.status is None:
            return f"its process (pid {self.pid}) ended without recording an error (how, the launcher's output says)"
        if os.WIFSIGNALED(self.status):
            number = os.WTERMSIG(self.status)
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            core = ", core dumped" if os.WCOREDUMP(self.status) else ""
            return f"killed by {name} (pid {self.pid}{core})"
        code = os.WEXITSTATUS(self.status)
        return f"exited with code {code} without recording an error (pid {self.pid})" if code else None


class Peers:
    """The other ranks of this machine, watched from a thread until `stop`."""

    def __init__(self, ranks: dict[int, tuple[int, str | None]]):
        self._fds: dict[int, tuple[int, int]] = {}  # pidfd -> (rank, pid)
        for rank, (pid, started) in ranks.items():
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # already gone, or no pidfds here
                continue
            if start_time(pid) != started:  # the pid is another process's now
                os.close(fd)
                continue
            self._fds[fd] = (rank, pid)
        self._ended: list[Ended] = []
        self._changed = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="gptlite-peers", daemon=True)
        self._thread.start()

    @classmethod
    def watch(cls, rank: int) -> "Peers | None":
        """Collective: every rank tells the others its machine and pid, and watches those of its own
        machine. None without a process group of several real ranks, or where nothing can be watched."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or is_fake_process_group() \
                or not hasattr(os, "pidfd_open"):
            return None
        me = (machine_id(), os.getpid(), start_time(os.getpid()))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, me)
        mine = {r: (pid, started) for r, (where, pid, started) in enumerate(everyone)
                if r != rank and where is not None and where == me[0]}
        return cls(mine) if mine else None

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        pending = set(self._fds)
        while pending:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    return
                rank, pid = self._fds[fd]
                ended = Ended(rank, pid, _exit_status(fd, pid), time.time())
                poller.unregister(fd)
                pending.discard(fd)
                with self._changed:
                    self._ended.append(ended)
                    self._changed.notify_all()

    def ended(self, wait_s: float = 0.0) -> list[Ended]:
        """The ranks of this machine that died (a signal, or an exit without recording an error), in
        the order they ended. `wait_s`: how long to wait for one where none has yet: a survivor's
        broken connection can come before the kernel has finished ending the rank that broke it."""
        def died() -> list[Ended]:
            return [e for e in self._ended if e.describe() is not None]

        with self._changed:
            if wait_s > 0:
                self._changed.wait_for(lambda: bool(died()), timeout=wait_s)
            return died()

    def stop(self) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        for fd in (*self._fds, self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
