"""A model too large for the machine is refused before anything is built or recorded.

Every rank builds the whole model in its own process memory before the backend shards it or moves
it to a device (training/run.py: `workload.build`), so the ranks on one machine need at least their
number times the model's bytes (parameters and buffers, from the meta-device model) of host memory,
and on CUDA each rank at least the model's bytes free on its device. That floor holds under every
backend and sharding; a run below it ends in the allocator's failure (bad_alloc, SIGKILL by the
kernel's OOM killer) after its record exists. Above the floor the run is left to measure: the
activation and optimizer peak is the estimator's business (estimator/estimate.py, which --ckpt_policy
auto plans with; a run is not refused on it), and --mem_budget_gb is a budget the run's measured peak is held
to (a run over it is recorded `oom`, which sweep.py --max_batch relies on), not a refusal.
"""

from __future__ import annotations

import torch

from core.dist import DistEnv, is_fake_process_group
from gptlite.errors import ConfigError


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as built (the meta-device model's dtypes)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def available_host_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), or None where
    it does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_model_fits(cfg, env: DistEnv, model: torch.nn.Module) -> None:
    """ConfigError (one line naming --model/--model_args) when the model cannot even be built."""
    size = model_bytes(model)
    sizes = [name for name in ("n_layer", "n_embd") if getattr(cfg, name, None) is not None]
    flag = "model_args" if cfg.model_args else ("/".join(sizes) or "preset" if cfg.model == "gptlite" else "model")
    what = f"{flag}: the model's parameters and buffers take {_gb(size)}"
    host = available_host_bytes()
    # A simulated world (simulation/fake_world.py) runs one rank of it here, whatever its ranks per node.
    ranks = 1 if is_fake_process_group() else max(1, env.local_world_size)
    if host is not None and size * ranks > host:
        on = f"on each of the {ranks} ranks on this machine ({_gb(size * ranks)})" if ranks > 1 else "on the host"
        raise ConfigError(f"{what}, built whole {on}, and this machine has {_gb(host)} available; "
                          "choose a smaller model or fewer ranks per machine")
    if env.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(env.device)
        if size > free:
            raise ConfigError(f"{what} and {env.device} has {_gb(free)} free; choose a smaller model")
