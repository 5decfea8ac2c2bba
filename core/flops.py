"""Model FLOPs and MFU.

Model FLOPs per token (PaLM's accounting): 6 x the parameters that take part in matmuls (all but
the embedding tables, which are lookups) for forward and backward, plus attention's
12 x n_layer x n_embd x T (the QK^T and AV matmuls, causal masking not subtracted). Recomputation
by activation checkpointing is not counted: that is hardware FLOPs (HFU), not model FLOPs.
"""

from __future__ import annotations

from gptlite.model import GPTConfig

# Dense bf16 tensor-core peak FLOP/s by device name substring, from the vendors' datasheets.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}


def matmul_params(cfg: GPTConfig, n_params: int) -> int:
    return n_params - (cfg.vocab_size + cfg.block_size) * cfg.n_embd


def flops_per_token(cfg: GPTConfig, n_params: int) -> float:
    return 6 * matmul_params(cfg, n_params) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def counted_flops(model, *inputs) -> int:
    """FLOPs of one forward and backward of `model` on `inputs` as torch.utils.flop_counter counts
    them: every matmul, convolution and attention kernel (elementwise work is not counted, as in
    the formula above), whatever the model. `model(*inputs)` returns the loss, or a tuple whose
    last element is. On the meta device it costs no memory and little time."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
        loss = out[-1] if isinstance(out, tuple) else out
        loss.backward()
    return counter.get_total_flops()


def counted_flops_per_token(cfg: GPTConfig) -> float:
    """GPT-lite's FLOPs per token, counted (counted_flops) on the meta device over one sequence."""
    import torch

    from gptlite.model import meta_model

    model = meta_model(cfg)
    idx = torch.zeros(1, cfg.block_size, dtype=torch.long, device="meta")
    return counted_flops(model, idx, idx) / cfg.block_size


def peak_flops(device_name: str) -> float | None:
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return None


def mfu(tokens_per_s: float | None, cfg: GPTConfig, n_params: int, device_name: str, world_size: int) -> float | None:
    """Model FLOPs utilisation of all devices together, or None when the peak is unknown."""
    peak = peak_flops(device_name)
    if peak is None or tokens_per_s is None:
        return None
    return tokens_per_s * flops_per_token(cfg, n_params) / (peak * world_size)
