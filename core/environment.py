"""Where and with what a run ran: library versions, git commit, host, device name."""

from __future__ import annotations

import functools
import importlib.metadata
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


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    }
