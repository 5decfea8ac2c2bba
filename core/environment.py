"""Where and with what a run ran: library versions, git commit, host, device name."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

from core import allocator

_LIBRARIES = ("torch", "deepspeed", "accelerate", "numpy")
_REPO = Path(__file__).resolve().parent.parent


def library_versions() -> dict[str, str | None]:
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@functools.lru_cache(maxsize=1)
def git_commit() -> dict[str, str | bool | None]:
    """The checkout's commit and whether tracked files differ from it, read once per process (two git
    commands; a process running several runs, or the test process, asks once)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def cpu_name(cpuinfo: str | None = None, ids: bool = True) -> str | None:
    """The CPU as /proc/cpuinfo (or the text `cpuinfo`) names its first processor: its model name and,
    with `ids`, its family, model and stepping where the file has them (x86); None without a name.
    A virtual machine's model name can hide its generation: on 2026-12-03 two virtual machines of the
    development kind both named "AMD EPYC" (the second family 26, a Zen 5) read the planner's
    reference step 1.6-2.8 ms and 0.7-1.1 ms, and rounded the reference run's third loss apart
    (cpu-2core-zoo-two-reads of docs/results/zoo_accuracy_2026-12-05.md). (py-cpuinfo, which DeepSpeed brings, says the same by
    starting an interpreter: 1.2 s of CPU, tests/support/forkserver.py.)"""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    first = cpuinfo.split("\n\n", 1)[0]
    fields = {k.strip(): v.strip() for k, sep, v in (line.partition(":") for line in first.splitlines()) if sep}
    if "model name" not in fields:
        return None
    found = [f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping") if ids and fields.get(k)]
    return fields["model name"] + (f" ({', '.join(found)})" if found else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name(ids=False) or platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    return {
        "versions": library_versions(),
        "git": git_commit(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "allocator": allocator.describe(),
        "argv": sys.argv,
        # inductor's settings given by environment (TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1, say): they
        # change the generated kernels and so the speed, and the command line does not show them
        "inductor_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHINDUCTOR_")},
    }
