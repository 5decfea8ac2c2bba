"""Where a run executes: rank, world, device, and the process group.

Launchers (torchrun, the deepspeed launcher, accelerate launch) all describe a rank through the
same environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). A plain
`python train.py` sets none of them and runs as a world of one.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from core.ports import free_port
from gptlite.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    launcher: str  # the launcher that started it: python, torchrun, deepspeed, accelerate, or env (another)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @classmethod
    def from_environment(cls, device: str = "auto") -> "DistEnv":
        env = os.environ
        world = int(env.get("WORLD_SIZE", 1))
        # torchrun: LOCAL_WORLD_SIZE; the deepspeed launcher: LOCAL_SIZE.
        local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", world)))
        local_rank = int(env.get("LOCAL_RANK", 0))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("device cuda: CUDA is not available on this machine (use --device cpu or auto)")
            dev = torch.device("cuda", local_rank)
        else:
            dev = torch.device("cpu")
        return cls(int(env.get("RANK", 0)), local_rank, world, local_world, dev, _launcher(env))


def _launcher(env) -> str:
    if "ACCELERATE_MIXED_PRECISION" in env:  # every `accelerate launch` path sets it (it runs torchrun inside)
        return "accelerate"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "CROSS_RANK" in env or "LOCAL_SIZE" in env:  # set by deepspeed's launcher for each rank
        return "deepspeed"
    return "env" if "WORLD_SIZE" in env else "python"


def stop_with_launcher() -> None:
    """Under a launcher, have the kernel send this rank SIGTERM if the launcher dies.

    torchrun starts each rank in a session of its own, so a launcher killed outright (SIGKILL, an
    OOM kill) would leave its ranks training with nobody to stop them. With this, they get
    SIGTERM instead, record the failure and exit. Linux only; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux") or "LOCAL_RANK" not in os.environ:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher was already gone before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def ensure_rendezvous_env() -> None:
    """A plain `python train.py` gets a world-of-one rendezvous on a free local port."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")


def init_process_group(env: DistEnv, timeout_s: float) -> None:
    if dist.is_initialized():
        return
    ensure_rendezvous_env()
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    dist.init_process_group(
        backend=env.comm_backend,
        timeout=timedelta(seconds=timeout_s),
        # Binding the device lets NCCL set up communicators eagerly; gloo needs no device.
        device_id=env.device if env.device.type == "cuda" else None,
    )


def is_fake_process_group() -> bool:
    """Whether this process runs one rank of a simulated world (simulation/fake_world.py)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def fake_world_allreduce_hook(state, bucket):
    """DDP communication hook for the fake process group, whose work futures carry no tensor
    (DDP's reducer refuses that): issue the same all-reduce of the bucket, so it is counted as the
    reducer's own would be, and hand the bucket back."""
    dist.all_reduce(bucket.buffer())
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def set_cpu_threads(env: DistEnv) -> int:
    """Share the cores among the ranks of this node unless the user chose (OMP_NUM_THREADS).

    Two ranks each using every core oversubscribe the CPU and make every backend look slower
    than it is, by an amount that depends on the launcher.
    """
    if env.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // env.local_world_size))
    return torch.get_num_threads()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values`, indexed [rank][i]; without a process group, just ours. In a simulated
    world (fake process group) too: the other ranks' values do not exist, and a list of a million
    ranks' tensors would cost memory that grows with the simulated world, which no real rank pays."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or is_fake_process_group():
        return [list(values)]
    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
