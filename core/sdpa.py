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

from gptlite.errors import ConfigError

# "auto": torch's choice among all of them (its default); the others, that kernel alone.
SDPA_KERNELS = ("auto", "flash", "efficient", "cudnn", "math")
CUDA_ONLY = ("efficient", "cudnn")


def sdpa_backends(kernel: str) -> list:
    """torch's SDPBackend list for a --sdpa_kernel value (torch.nn.attention.sdpa_kernel takes it)."""
    from torch.nn.attention import SDPBackend

    table = {"flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
             "cudnn": [SDPBackend.CUDNN_ATTENTION], "math": [SDPBackend.MATH]}
    if kernel == "auto":
        return [b for backends in table.values() for b in backends]
    if kernel not in table:
        raise ConfigError(f"sdpa_kernel must be one of {', '.join(SDPA_KERNELS)} (got {kernel!r})")
    return table[kernel]


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
    import torch

    on = {"flash": False, "efficient": False, "cudnn": False, "math": False}
    for name in (on if kernel == "auto" else (kernel,)):
        if name not in on:
            raise ConfigError(f"sdpa_kernel must be one of {', '.join(SDPA_KERNELS)} (got {kernel!r})")
        on[name] = True
    torch.backends.cuda.enable_flash_sdp(on["flash"])
    torch.backends.cuda.enable_mem_efficient_sdp(on["efficient"])
    torch.backends.cuda.enable_cudnn_sdp(on["cudnn"])
    torch.backends.cuda.enable_math_sdp(on["math"])
