"""GPT-lite's memory model: parameter counts, the activations a block keeps, and how each backend
lays out the model states. The terms estimator/estimate.py adds up (its docstring gives the formulas
and their accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gptlite.errors import ConfigError
from gptlite.model import GPTConfig, meta_model

F32 = 4
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


@dataclass
class Layout:
    """How a backend holds the model: the inputs of the estimate that depend on the backend."""

    kind: str  # replicated | full_shard | shard_grad_op | zero12 | zero3
    shards: int = 1
    ddp_bucket: bool = False  # DDP keeps a gradient bucket the size of all gradients
    grads_beside_buckets: bool = False  # and the gradients apart from it (not bucket views)
    fsdp1_root_gathered: bool = False
    # FSDP2 resharding to a group of this many ranks after forward (reshard_after_forward as an
    # integer): each parameter's 1/post_forward kept from its forward until its backward.
    post_forward: int = 0
    # ZeRO++ hpZ: a secondary copy of the parameters partitioned over this many ranks.
    hpz: int = 1
    offload: bool = False
    compute_bytes: int = F32  # bytes of the parameters the forward computes with
    ds: dict = field(default_factory=dict)


def layout_for(backend: str, world: int, precision: str, fsdp_options=None, ds_config: dict | None = None,
               ranks_per_node: int | None = None) -> Layout:
    c = 2 if precision in ("bf16", "fp16") else F32
    if backend in ("single", "ddp", "accelerate"):
        # accelerate's Accelerator runs DDP underneath, without gradients as views of its buckets.
        return Layout("replicated", ddp_bucket=backend != "single", grads_beside_buckets=backend == "accelerate")
    if backend == "fsdp":
        from backends import fsdp_config
        from backends.fsdp_config import FSDPConfig

        o = fsdp_options or FSDPConfig()
        mp = c if o.mixed_precision else F32
        if o.sharding_strategy == "NO_SHARD" or world == 1:
            # FSDP1 runs every strategy as NO_SHARD on one rank (it switches and warns).
            return Layout("replicated", offload=o.cpu_offload, compute_bytes=mp)
        shards = world
        if o.sharding_strategy in fsdp_config.HYBRID_STRATEGIES:
            shards = o.hybrid_shard_size or ranks_per_node or world
            if shards < 2 or world % shards:
                raise ConfigError(f"hybrid_shard_size {shards} must be >= 2 and divide the world size {world}")
        kind = "shard_grad_op" if o.sharding_strategy in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2") else "full_shard"
        return Layout(kind, shards, fsdp1_root_gathered=True, offload=o.cpu_offload, compute_bytes=mp)
    if backend == "fsdp2":
        from backends.fsdp_config import FSDP2Config

        from backends.fsdp_config import hybrid_groups, post_forward_group

        o = fsdp_options or FSDP2Config()
        per_node = ranks_per_node or world
        _, shards = hybrid_groups(o, world, per_node)  # the mesh's shard group (the world without one)
        post = post_forward_group(o, shards, per_node)
        # Resharded to the whole shard group (true; also on one rank) / kept whole (false) / to a smaller group.
        kind = "full_shard" if post == shards else "shard_grad_op" if post == 1 else "full_shard"
        return Layout(kind, shards, offload=o.cpu_offload, compute_bytes=c if o.mixed_precision else F32,
                      post_forward=post if 1 < post < shards else 0)
    if backend == "deepspeed":
        zero = (ds_config or {}).get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        offload = any(((zero.get(k) or {}).get("device") or "none") != "none"
                      for k in ("offload_optimizer", "offload_param"))
        kind = {0: "replicated", 1: "zero12", 2: "zero12", 3: "zero3"}[stage]
        hpz = int(zero.get("zero_hpz_partition_size") or 1) if stage == 3 else 1
        return Layout(kind, world, offload=offload, compute_bytes=c, ds=zero, hpz=hpz if 1 < hpz < world else 1)
    raise ConfigError(f"backend must be one of single, ddp, accelerate, fsdp, fsdp2, deepspeed (got {backend!r})")
