"""Which of torch's scaled_dot_product_attention kernels a run lets sdpa choose (--sdpa_kernel).

torch picks a kernel per call from those enabled: on Hopper with torch 2.11, cuDNN's; on a CPU, its
flash kernel (math where it refuses). Naming one (issue 43): the paper preset's attention, with its
dropout 0.1, is about a third of an H200's step, and the kernels differ in speed at one shape
(benchmarks/sdpa_kernels.py times them); DeepSpeed's DeepCompile also failed compiling the evaluation's
no-grad cuDNN attention (runs/reference/nvidia-h200/README.md). The choice is process-wide (torch's own
toggles, torch.backends.cuda.enable_*_sdp), read by eager calls and by torch.compile when it traces,
for GPT-lite's sdpa and for any model that calls sdpa (transformers' "sdpa" attention).
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from gptlite.errors import ConfigError

# "auto": torch's choice among all of them (its default); the others, that kernel alone. Each kernel:
# its torch.nn.attention.SDPBackend member and its process-wide toggle in torch.backends.cuda.
SDPA_KERNELS = ("auto", "flash", "efficient", "cudnn", "math")
_TORCH = {"flash": ("FLASH_ATTENTION", "enable_flash_sdp"), "efficient": ("EFFICIENT_ATTENTION", "enable_mem_efficient_sdp"),
          "cudnn": ("CUDNN_ATTENTION", "enable_cudnn_sdp"), "math": ("MATH", "enable_math_sdp")}
CUDA_ONLY = ("efficient", "cudnn")


def _enabled(kernel: str) -> tuple[str, ...]:
    """The kernels a --sdpa_kernel value lets run."""
    if kernel == "auto":
        return tuple(_TORCH)
    if kernel not in _TORCH:
        raise ConfigError(f"sdpa_kernel must be one of {', '.join(SDPA_KERNELS)} (got {kernel!r})")
    return (kernel,)


def sdpa_backends(kernel: str) -> list:
    """torch's SDPBackend list for a --sdpa_kernel value (torch.nn.attention.sdpa_kernel takes it)."""
    return [getattr(SDPBackend, _TORCH[name][0]) for name in _enabled(kernel)]


def check_device(kernel: str, device_type: str, dropout: float | None = None) -> None:
    """A kernel this device does not have is refused before anything runs (torch would fail at the
    first attention call, mid-run, with 'No available kernel'). `dropout`: the model's, where known."""
    if kernel in CUDA_ONLY and device_type != "cuda":
        raise ConfigError(f"sdpa_kernel {kernel} is a CUDA kernel; on {device_type} use auto, flash or math")
    if kernel == "flash" and device_type == "cpu" and dropout:
        raise ConfigError(f"sdpa_kernel flash on a CPU has no dropout (torch's CPU flash kernel refuses it) and the "
                          f"model's is {dropout:g}; use auto or math, or --dropout 0")


def apply_sdpa_kernel(kernel: str) -> None:
    """Enable `kernel` alone for this process (auto: all of them, torch's default). A run is one process;
    set every time, so that an earlier in-process run's choice does not carry over."""
    enabled = _enabled(kernel)
    for name, (_, toggle) in _TORCH.items():
        getattr(torch.backends.cuda, toggle)(name in enabled)
