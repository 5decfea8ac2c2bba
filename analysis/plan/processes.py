"""The processes a calibration starts: deaf to a terminal's Ctrl-C, stopped if the plan leaves before
they end, and each one's message gathered (a process that ends without one fails the plan, not hangs it)."""

from __future__ import annotations

import atexit
import contextlib
import os
import queue as queues
import shlex
import shutil
import tempfile
from multiprocessing import spawn
from pathlib import Path


_DEAF: dict[str, Path] = {}  # Python -> the script that starts it with SIGINT ignored, kept while this process runs


def _deaf_python(python: str) -> Path:
    """A shell script that ignores SIGINT and execs `python` with its arguments. It must outlive the
    starts (the shell reads it after the exec), so it lives, once, until this process ends."""
    if python not in _DEAF:
        tmp = tempfile.mkdtemp(prefix="gptlite-deaf-")
        atexit.register(shutil.rmtree, tmp, True)
        script = Path(tmp) / "python"
        script.write_text(f"#!/bin/sh\ntrap '' INT\nexec {shlex.quote(python)} \"$@\"\n")
        script.chmod(0o700)
        _DEAF[python] = script
    return _DEAF[python]


@contextlib.contextmanager
def started(procs: list):
    """`procs` (multiprocessing processes, spawned) started deaf to Ctrl-C, and stopped if this process
    leaves before they end. A terminal's Ctrl-C signals every process in its foreground group: each
    spawned child would print its own KeyboardInterrupt traceback. Each starts through a two-line shell
    script that ignores SIGINT and execs Python: ignored from the interpreter's first instruction, which
    then installs no KeyboardInterrupt handler. This process keeps its own handler throughout, so a
    Ctrl-C while they start (seconds, on a loaded machine) stops it too; ignoring SIGINT here while they
    started would lose that one."""
    python = spawn.get_executable()
    spawn.set_executable(str(_deaf_python(os.fsdecode(python))))
    try:
        for proc in procs:
            proc.start()
    finally:
        spawn.set_executable(python)
    try:
        yield procs
    finally:
        for proc in procs:
            if getattr(proc, "pid", None) is not None and proc.exitcode is None:  # started, not ended
                proc.terminate()
                proc.join(10)


def gather_messages(queue, procs: list, what: str, poll_s: float = 1.0) -> list:
    """One message from each of `procs` (each puts one before it ends), as they come. A process that
    ended without one (killed, or failed before it could say why: a script that spawns without an
    `if __name__ == "__main__"` guard fails so at its children's start) raises RuntimeError naming its
    exit code, where waiting for its message would wait forever (2026-12-04: a probe script hung so
    for ten minutes, its calibration's two children ended)."""
    got = []
    while len(got) < len(procs):
        try:
            got.append(queue.get(timeout=poll_s))
        except queues.Empty:
            ended = [p.exitcode for p in procs if p.exitcode is not None]
            if len(ended) > len(got):  # an ended process's message is in the pipe by then: one more look
                try:
                    got.append(queue.get(timeout=poll_s))
                except queues.Empty:
                    for p in procs:  # the others would wait for it (a barrier) until their own timeout
                        if p.exitcode is None:
                            p.terminate()
                    raise RuntimeError(f"{what} failed: a process ended without a word (exit codes "
                                       f"{', '.join(map(str, ended))})") from None
    return got
