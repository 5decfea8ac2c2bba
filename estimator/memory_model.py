"""GPT-lite's memory model: parameter counts, the activations a block keeps, and how each backend
lays out the model states. The terms estimator/estimate.py adds up (its docstring gives the formulas
and their accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gptlite.model import GPTConfig, meta_model

from backends.memory_layout import F32
# DeepSpeed's defaults, when a config does not set them.
DS_REDUCE_BUCKET = 5e8
DS_PREFETCH_BUCKET = 5e7
DS_MAX_LIVE = 1e9
DS_PERSISTENCE = 1e5


@dataclass
class Counts:
    """Parameter counts of the model, from the model itself (built on the meta device)."""

    total: int
    per_block: list[int]  # parameters of each block, in order
    root: int  # embeddings, final LayerNorm, lm_head: FSDP's root unit
    head: int  # final LayerNorm and lm_head: their gradients come first in backward
    tensors: int
    small: list[int]  # sizes of every parameter tensor, for ZeRO-3's persistence threshold
    # Of those, the frozen ones (requires_grad False): no gradient, no optimizer state.
    frozen_per_block: list[int] = field(default_factory=list)  # [] where no block has any
    frozen_root: int = 0
    frozen_tensors: int = 0

    @property
    def trainable(self) -> int:
        return self.total - sum(self.frozen_per_block) - self.frozen_root

    @property
    def trainable_root(self) -> int:
        return self.root - self.frozen_root

    @property
    def trainable_per_block(self) -> list[int]:
        return [b - f for b, f in zip(self.per_block, self.frozen_per_block or [0] * len(self.per_block))]

    @classmethod
    def of(cls, cfg: GPTConfig) -> "Counts":
        model = meta_model(cfg)
        sizes = [p.numel() for p in model.parameters()]
        block = sum(p.numel() for p in model.blocks[0].parameters())
        head = sum(p.numel() for p in (*model.ln.parameters(), *model.lm_head.parameters()))
        return cls(sum(sizes), [block] * cfg.n_layer, sum(sizes) - cfg.n_layer * block, head, len(sizes), sizes)


def activation_per_block(cfg: GPTConfig, micro_batch: int, act_bytes: int, mask_bytes: int, device: str,
                         autocast: bool = False) -> int:
    B, T, C, H = micro_batch, cfg.block_size, cfg.n_embd, cfg.n_head
    btc, bht2 = B * T * C, B * H * T * T
    total = 12 * btc * act_bytes + 16 * B * T
    if autocast:
        # The residual stream stays fp32 (block input and the mid-block sum, which the LayerNorms
        # save), and the LayerNorm outputs are fp32: q, k and v each save their own 16-bit cast.
        total += 2 * btc * (F32 - act_bytes) + 2 * btc * act_bytes
    materialised = cfg.attention == "naive" or (cfg.dropout > 0 and device == "cpu")
    if materialised:
        total += bht2 * act_bytes + (T * T if cfg.attention == "naive" else 0)  # naive's causal mask
    else:  # fused attention: its log-sum-exp instead of the T x T probabilities
        total += B * H * T * F32
    if cfg.dropout > 0:
        total += 2 * btc * mask_bytes
        if materialised:
            total += bht2 * (act_bytes + mask_bytes)
    return total


def head_activations(cfg: GPTConfig, micro_batch: int, act_bytes: int, residual_bytes: int) -> int:
    """What the final LayerNorm, lm_head and the loss keep: alive until backward leaves the head."""
    B, T, C, V = micro_batch, cfg.block_size, cfg.n_embd, cfg.vocab_size
    return B * T * C * (residual_bytes + act_bytes) + 8 * B * T + B * T * V * F32  # LN input, lm_head input, log-softmax


def backward_transient(cfg: GPTConfig, micro_batch: int, act_bytes: int, mask_bytes: int, device: str,
                       autocast: bool = False, residual_bytes: int = F32) -> int:
    """The most one block's backward holds beyond what the block keeps (activation_per_block): with
    attention materialised, its T x T gradients, less what the block's backward has already freed
    by then (it runs the feed-forward and the attention's projection first: the mid-block sum and
    LayerNorm output, the 4C-wide ReLU output, the attention output, and their dropout masks).
    Measured (CPU, fp32, small preset, dropout 0.2): the peak of a step without checkpointing within
    0.1% of this, where adding the T x T gradients to everything the block keeps was 3.5% over."""
    B, T, C, H = micro_batch, cfg.block_size, cfg.n_embd, cfg.n_head
    btc = B * T * C
    materialised = cfg.attention == "naive" or (cfg.dropout > 0 and device == "cpu")
    if not materialised:
        # Fused attention: measured on an H100 (runs/reference/), about 10 B T C elements at once,
        # the feed-forward's two 4C-wide gradients and the block's input and output gradients.
        return 10 * btc * act_bytes
    ln_out = F32 + act_bytes if autocast else act_bytes  # under autocast, fp32 and fc1's 16-bit cast
    freed = btc * (residual_bytes + ln_out + 4 * act_bytes + act_bytes) + (2 * btc * mask_bytes if cfg.dropout > 0 else 0)
    # The feed-forward's own backward: its two 4C-wide gradients beside everything the block keeps.
    return max((2 * B * H * T * T + btc) * act_bytes - freed, 8 * btc * act_bytes)
