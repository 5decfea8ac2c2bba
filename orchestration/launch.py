"""How a run is launched, the way users launch it: one module for the sweep and the tests.

    python train.py ...                                              single (one process)
    torchrun --nproc_per_node N --rdzv-endpoint 127.0.0.1:PORT ...   torch backends
    deepspeed --num_gpus N --master_port PORT train.py ...           DeepSpeed

Every launch gets a free port (fixed ports collide between back-to-back runs) and an environment
whose PATH starts with this interpreter's directory: its launchers, and the ninja that builds
DeepSpeed's ops (another ninja on PATH would make it rebuild them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import backends
from core.ports import free_port

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "train.py"
LAUNCHERS = ("python", "torchrun", "deepspeed")


def launcher_for(backend: str) -> str:
    """The launcher users of `backend` type (Backend.launcher): python for single, deepspeed for DeepSpeed,
    torchrun else."""
    return backends.get_backend(backend).launcher


def python_command(*args: str) -> list[str]:
    """The command that starts a Python process of this interpreter on `args` (a script or `-m
    MODULE`, then its arguments): every process the suite starts without a launcher starts here."""
    return [sys.executable, *map(str, args)]


def run_python(*args: str) -> subprocess.CompletedProcess:
    """`python ARGS` (python_command) to completion in the repository, its output captured as text:
    a tool's child process (the projection's fake-world counts)."""
    return subprocess.run(python_command(*args), cwd=REPO, capture_output=True, text=True)


def launch_command(launcher: str, nproc: int, script: Path = TRAIN) -> list[str]:
    """The command that starts `script` on `nproc` local ranks (plain python: one process)."""
    bindir = Path(sys.executable).parent
    if launcher == "python":
        return python_command(script)
    if launcher == "deepspeed":
        return [str(bindir / launcher), "--num_gpus", str(nproc), "--master_port", str(free_port()), str(script)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script)]
    raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)} (got {launcher!r})")


def launch_env(extra: dict | None = None) -> dict:
    """The environment of a launched run: this one, the repository importable first (then what
    PYTHONPATH held already: a user's model file may import from it), our tools first on PATH."""
    env = {**os.environ, **(extra or {})}
    paths = [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env
